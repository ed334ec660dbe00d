"""A real Slurm on this one host, for the tests and for trying ``slurm/qarl.sbatch`` without a cluster:
slurmctld and one slurmd per node, auth/none, every file under one folder, every port picked free.

    with LocalSlurm(root, nodes=2) as slurm:      # Debian: apt-get install slurmctld slurmd slurm-client
        job = slurm.sbatch(["slurm/qarl.sbatch", "configs/cpu_default.yaml", "train.steps=2"], cwd=repo)
        state = slurm.wait(job, timeout_s=900)    # COMPLETED, FAILED, ...

    python -m launch.local_slurm --root /tmp/qs --nodes 2   # up until Ctrl-C; prints the SLURM_CONF to export

Nodes are named q1, q2, ... and each gets its own loopback address (NodeAddr 127.0.0.2, 127.0.0.3, ...), so
Ray sees them as distinct machines and all traffic stays on the loopback interface. Each node claims every
core of the host (the host's CPUs are shared by its slurmd's).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from megatron_qarl.moe.parallelize import free_port
from megatron_qarl.utils.processes import reap

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def find_binary(name: str) -> str | None:
    """``name`` on PATH, else in /usr/sbin or /usr/bin (a root PATH may lack sbin)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/usr/local/sbin:/usr/local/bin")


def missing_binaries() -> list[str]:
    """The Slurm programs this host lacks (empty: a local Slurm can start)."""
    return [b for b in (*DAEMONS, *CLIENTS) if not find_binary(b)]


def host_memory_mb() -> int:
    try:
        out = subprocess.run([find_binary("slurmd") or "slurmd", "-C"], capture_output=True, text=True,
                             timeout=30).stdout
        m = re.search(r"RealMemory=(\d+)", out)
        if m:
            return int(m.group(1))
    except (OSError, subprocess.SubprocessError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20


def slurm_conf(root: Path, *, nodes: int, cpus: int, memory_mb: int, ctld_port: int, node_ports: list[int],
               node_addrs: list[str]) -> str:
    """slurm.conf of a one-host cluster: the settings found to work with Debian's Slurm 22.05 (docs/cluster.md,
    "Trying it without a cluster"); each node a slurmd of its own with its own port and NodeAddr."""
    lines = [
        "ClusterName=qarltest",
        f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",  # must name this host
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={node_ports[0]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/none",
        # cred_expire also sets how long slurmd refuses to relaunch a killed job id, so how long a requeued job
        # is held back (default 120 s); starting it earlier gets "Job credential revoked" and the job FAILS
        "AuthInfo=cred_expire=10",
        "CredType=cred/none",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobRequeue=1",
        "KillWait=30",
        "SlurmdTimeout=600",
    ]
    for i in range(nodes):
        lines.append(f"NodeName=q{i + 1} NodeAddr={node_addrs[i]} Port={node_ports[i]} CPUs={cpus} "
                     f"RealMemory={memory_mb} State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
    return "\n".join(lines) + "\n"


class LocalSlurm:
    """slurmctld + ``nodes`` slurmd under ``root``; ``env`` is what clients need (SLURM_CONF)."""

    def __init__(self, root: str | Path, nodes: int = 1, *, cpus: int | None = None):
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Slurm is not installed (missing {', '.join(missing)}): apt-get install -y "
                               f"--no-install-recommends slurmctld slurmd slurm-client")
        self.root = Path(root).resolve()
        self.nodes = [f"q{i + 1}" for i in range(nodes)]
        self.addrs = [f"127.0.0.{i + 2}" for i in range(nodes)]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    # --------------------------------------------------------------------------------------- daemons
    def start(self, timeout_s: float = 60.0) -> LocalSlurm:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ports = [free_port() for _ in range(len(self.nodes) + 1)]
        self.conf.write_text(slurm_conf(self.root, nodes=len(self.nodes), cpus=self.cpus, memory_mb=host_memory_mb(),
                                        ctld_port=ports[0], node_ports=ports[1:], node_addrs=self.addrs))
        self._spawn("slurmctld", [find_binary("slurmctld"), "-D", "-c", "-f", str(self.conf)])
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
            self._spawn(f"slurmd-{node}", [find_binary("slurmd"), "-D", "-f", str(self.conf), "-N", node])
        try:
            self.wait_nodes_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / f"{name}.out", "ab")  # noqa: SIM115 - owned by the daemon
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))
        out.close()

    def node_states(self) -> dict[str, str]:
        out = self.run(["scontrol", "show", "node", "-o"], check=False).stdout
        states = {}
        for line in out.splitlines():
            name, state = re.search(r"NodeName=(\S+)", line), re.search(r"\bState=(\S+)", line)
            if name and state:
                states[name.group(1)] = state.group(1)
        return states

    def wait_nodes_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args[0]} rc {p.returncode}); logs in {self.root}:"
                                       f"\n{self.logs()}")
            states = self.node_states()
            if len(states) == len(self.nodes) and all(s.split("+")[0] == "IDLE" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {timeout_s:.0f} s: {states}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Cancel every job (their processes end with them), then stop the daemons this object started."""
        if any(p.poll() is None for p in self.procs):
            self.run(["scancel", "--full", "--partition=debug"], check=False)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:  # SIGTERM was sent above: up to 30 s to exit, then SIGKILL and 10 s (utils/processes.py)
            reap(p, f"Slurm daemon {p.args[0]}", exit_wait_s=30.0, grace_s=0.0)
        self.procs = []

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------------- clients
    def run(self, cmd: list[str], *, check: bool = True, cwd: str | Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        exe = find_binary(cmd[0]) or cmd[0]
        proc = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, cwd=cwd,
                              env={**self.env, **(env or {})}, timeout=120)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None) -> str:
        """Submit; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` fields (JobState, ExitCode, Restarts, StdOut, ...); {} once it is gone."""
        proc = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}

    def wait(self, job_id: str, timeout_s: float = 600.0, poll_s: float = 1.0) -> dict[str, str]:
        """Poll until the job reaches a final state; returns its fields (TimeoutError when it does not)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not finished after {timeout_s:.0f} s: {info}")
            time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.local_slurm", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="folder for the config, state, spool and logs")
    parser.add_argument("--nodes", type=int, default=1)
    args = parser.parse_args(argv)
    with LocalSlurm(args.root, args.nodes) as slurm:
        print(f"export SLURM_CONF={slurm.conf}   # nodes {', '.join(slurm.nodes)} idle; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0
