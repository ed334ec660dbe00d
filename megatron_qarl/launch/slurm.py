"""The Python side of ``slurm/qarl.sbatch``: node lists, the Ray head address, the Ray start command of
each node, network interface variables, per-job log folders, and the ``qarl train`` command line with
``--resume`` when the run already has a checkpoint (a requeued job continues where it stopped).

    python -m launch.slurm submit [--dry-run] [--sbatch-arg=ARG ...] --config CONFIG [key.sub=value ...]
        (the launcher in the repository's launch/ folder; the config also as the first bare word, CONFIG, and the
        overrides anywhere on the line: megatron_qarl/cli.py parse_args) sbatch slurm/qarl.sbatch with --nodes /
        --gpus-per-node from the config's launch section and the job's log in <train.output_dir>/slurm/ (that
        folder is made first: sbatch does not make it)
and, inside the job, as slurm/qarl.sbatch runs them:
    python -m megatron_qarl.launch.slurm env CONFIG [key.sub=value ...]   shell assignments to eval (QARL_PREFLIGHT:
        the ``qarl preflight`` every node runs first, srun; QARL_TRAIN: the ``qarl train`` of the first node)
    python -m megatron_qarl.launch.slurm ray-node                          (one task per node, srun) ray start;
        a worker node whose start times out joining the head is started again (join_ray)
    python -m megatron_qarl.launch.slurm wait-ray --nodes N                until N Ray nodes are up

Everything here is plain functions of the Slurm environment variables (``SLURM_JOB_NODELIST``,
``SLURM_JOB_ID``, ``SLURMD_NODENAME``, ...) and of ``scontrol show node`` output, so it is unit-tested
without Slurm. Node names need not resolve as host names: a node's address is its ``NodeAddr``
(several slurmd on one host, each with its own loopback address, is how the tests run two nodes).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_qarl.cli import add_config_args, parse_args
from megatron_qarl.errors import UserError
from megatron_qarl.utils.api_key import ENV as API_KEY_ENV
from megatron_qarl.utils.api_key import from_env

SBATCH_SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "qarl.sbatch"
# how long `python -m launch.slurm submit` waits for sbatch (which waits on slurmctld); docs/cluster.md's table
SBATCH_TIMEOUT_S = 120.0
# what the cluster run always sets: Ray joins the job's cluster, rank 0 and the servers use node addresses
CLUSTER_OVERRIDES = ("launch.backend=ray", "launch.ray_address=auto", "launch.master_addr=auto",
                     "launch.server_host=0.0.0.0")


# ----------------------------------------------------------------------------------------- node lists
def _expand_brackets(item: str) -> list[str]:
    """``gpu[01-03,7]-x[1-2]`` -> every name, zero padding kept, bracket groups expanded left to right."""
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"node list {item!r}: bad range {part!r}")
        if not sep:
            values = [lo]
        else:
            if int(hi) < int(lo):
                raise ValueError(f"node list {item!r}: range {part!r} runs backwards")
            values = [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
        out += [head + v + rest for v in values for rest in _expand_brackets(tail)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (``SLURM_JOB_NODELIST``) as names, in order: ``n[1-2],gpu07`` ->
    ``['n1', 'n2', 'gpu07']`` (what ``scontrol show hostnames`` prints)."""
    items, depth, cur = [], 0, ""
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        cur += ch
    items.append(cur)
    names = [n for item in items if item for n in _expand_brackets(item)]
    if not names:
        raise ValueError(f"empty node list {nodelist!r}")
    return names


def job_nodes(env: Mapping[str, str] = os.environ) -> list[str]:
    """The job's nodes, batch (first) node first."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError("SLURM_JOB_NODELIST is not set: run this inside a Slurm job (sbatch slurm/qarl.sbatch)")
    return expand_nodelist(nodelist)


def parse_scontrol_node(text: str) -> dict[str, str]:
    """``scontrol show node -o NAME``'s ``Key=Value`` fields (values without spaces, as scontrol -o prints)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def node_address(node: str, scontrol: str = "scontrol", env: Mapping[str, str] = os.environ) -> str:
    """The IPv4 address other nodes reach ``node`` at: its Slurm NodeAddr, resolved when it is a name.

    Node names need not resolve (several slurmd on one host); NodeAddr then holds the address. Without
    scontrol (or when it fails) the node name itself is resolved.
    """
    addr = node
    exe = shutil.which(scontrol) or shutil.which(scontrol, path="/usr/bin:/usr/sbin")
    if exe:
        proc = subprocess.run([exe, "show", "node", "-o", node], capture_output=True, text=True, env=dict(env),
                              timeout=30)
        if proc.returncode == 0:
            addr = parse_scontrol_node(proc.stdout).get("NodeAddr") or node
    try:
        return str(ipaddress.IPv4Address(addr))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(addr)
    except OSError as err:
        raise UserError(f"node {node}: cannot resolve its address {addr!r}: {err}") from None


def interface_of(addr: str) -> str | None:
    """The network interface that holds ``addr`` (what NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name), or None."""
    ip = ipaddress.ip_address(addr)
    if ip.is_loopback:
        return "lo"
    try:
        import psutil
    except ImportError:  # psutil comes with ray[default]; without it the user sets the variables
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return name
    return None


def socket_env(addr: str, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for a node at ``addr``, unless the user set them."""
    iface = interface_of(addr)
    if not iface:
        return {}
    return {k: iface for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if not env.get(k)}


def ray_port(env: Mapping[str, str] = os.environ) -> int:
    """The Ray head's GCS port: QARL_RAY_PORT, else one derived from the job id (jobs sharing a node differ)."""
    if env.get("QARL_RAY_PORT"):
        return int(env["QARL_RAY_PORT"])
    return 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000


def node_gpus(env: Mapping[str, str] = os.environ) -> int:
    """GPUs Slurm gave this job on this node (0 on CPU nodes)."""
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"])
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) if visible and visible != "NoDevFiles" else 0


def node_cpus(env: Mapping[str, str] = os.environ) -> int:
    """CPUs Ray offers on this node: QARL_RAY_NUM_CPUS, else Slurm's CPUs of the job on it, else the cores."""
    for key in ("QARL_RAY_NUM_CPUS", "SLURM_CPUS_ON_NODE"):
        if env.get(key):
            return int(env[key])
    return os.cpu_count() or 1


def ray_tmpdir(env: Mapping[str, str] = os.environ) -> str:
    """Ray's temp dir for the job: QARL_RAY_TMPDIR, else /tmp/qarl-ray-<job id>. Not /tmp/ray: a ``ray start``
    there writes /tmp/ray/ray_current_cluster, which every plain ``ray.init()`` on the host then joins. Short:
    Ray's socket paths under it must stay within 107 characters."""
    return env.get("QARL_RAY_TMPDIR") or f"/tmp/qarl-ray-{env.get('SLURM_JOB_ID', '0')}"


def ray_start_command(*, head: bool, node_addr: str, head_addr: str, port: int, num_cpus: int, num_gpus: int,
                      temp_dir: str, ray: str = "ray") -> list[str]:
    """``ray start --block`` for one node: the head (GCS on ``port``, client server on port+1, no dashboard)
    or a worker joining ``head_addr:port``. ``--block`` ties the node's Ray to the srun task: ending the task
    ends that node's Ray, so nothing else on the host is touched (no ``ray stop``, which stops every Ray)."""
    cmd = [ray, "start", "--block", f"--node-ip-address={node_addr}", f"--num-cpus={num_cpus}",
           f"--num-gpus={num_gpus}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    if head:
        return cmd + ["--head", f"--port={port}", f"--ray-client-server-port={port + 1}", "--include-dashboard=false"]
    return cmd + [f"--address={head_addr}:{port}"]


def wait_port(addr: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise UserError(f"Ray head {addr}:{port} not reachable after {timeout_s:.0f} s: {err}") from None
            time.sleep(1)


# --------------------------------------------------------------------------------------- run config
def run_settings(config: str, overrides: Sequence[str]) -> dict:
    """The few config values the job script needs (output dir, layout), from the YAML and overrides only;
    ``qarl train`` validates the whole config itself."""
    from megatron_qarl.config import LaunchConfig, TrainConfig, load_config_dict

    data = load_config_dict(config, list(overrides))  # its paths as qarl train resolves them
    train, launch = data.get("train") or {}, data.get("launch") or {}
    return {
        "output_dir": str(train.get("output_dir", TrainConfig.model_fields["output_dir"].default)),
        "nodes": int(launch.get("nodes", LaunchConfig.model_fields["nodes"].default)),
        "gpus_per_node": int(launch.get("gpus_per_node", LaunchConfig.model_fields["gpus_per_node"].default)),
        "api_key": (data.get("rollout") or {}).get("api_key"),
        "server_python": (data.get("rollout") or {}).get("server_python"),
        "launch_prefix": list((data.get("rollout") or {}).get("launch_prefix") or []),
    }


def has_checkpoint(output_dir: str | Path) -> bool:
    """True when ``<output_dir>/checkpoints/latest`` exists: the job resumes."""
    return (Path(output_dir) / "checkpoints" / "latest").is_file()


def server_python_override(env: Mapping[str, str] = os.environ) -> list[str]:
    """``rollout.server_python=$QARL_SERVER_PYTHON`` when the job's environment names the rollout servers'
    interpreter (their own environment, docs/cluster.md); a JSON string, which YAML reads back verbatim."""
    python = env.get("QARL_SERVER_PYTHON", "").strip()
    return [f"rollout.server_python={json.dumps(python)}"] if python else []


def train_command(config: str, overrides: Sequence[str], *, nodes: int, python: str = sys.executable,
                  resume: bool = False, server_python: Sequence[str] = ()) -> list[str]:
    """``qarl train`` for a job on ``nodes`` nodes: the cluster overrides first (and ``server_python``, the
    QARL_SERVER_PYTHON override), the user's after (they win), ``--resume`` when the run has a checkpoint.
    ``--no-preflight``: the job has just run the whole of ``qarl preflight`` on every node (``preflight_command``),
    so qarl train does not repeat its part of it. No API key: it travels in the environment (``job_env``)."""
    cmd = [python, "-m", "megatron_qarl.cli", "train", "--config", config, "--no-progress", "--no-preflight"]
    cmd += ["--resume"] if resume else []
    cmd += [*CLUSTER_OVERRIDES, f"launch.nodes={nodes}"]
    return cmd + list(server_python) + list(overrides)


def preflight_command(train: Sequence[str]) -> list[str]:
    """``qarl preflight`` of the run ``train`` (QARL_TRAIN's argv) starts: the same interpreter, config and overrides,
    without qarl train's flags. slurm/qarl.sbatch runs it on every node before anything else."""
    i = list(train).index("train")
    flags = ("--no-progress", "--no-preflight", "--resume")
    return [*train[:i], "preflight", *[a for a in train[i + 1:] if a not in flags]]


def check_job_layout(settings: dict, nodes: int, gpus: int) -> None:
    """A GPU config is laid out for ``launch.nodes`` x ``launch.gpus_per_node``: the job must match."""
    want_n, want_g = settings["nodes"], settings["gpus_per_node"]
    if want_g and want_n != nodes:
        raise UserError(f"launch.nodes: the config is laid out for {want_n} nodes, this Slurm job has {nodes} "
                        f"(sbatch --nodes={want_n}, or python -m launch.slurm submit)")
    if want_g and gpus and want_g != gpus:
        raise UserError(f"launch.gpus_per_node: the config wants {want_g} GPUs per node, Slurm gave {gpus} "
                        f"(sbatch --gpus-per-node={want_g})")


def job_env(config: str, overrides: Sequence[str], env: Mapping[str, str] = os.environ,
            python: str = sys.executable) -> dict[str, str | list[str]]:
    """Everything the job script needs, computed on the batch (first) node. ``QARL_TRAIN`` and ``QARL_PREFLIGHT``
    are argvs."""
    nodes = job_nodes(env)
    server_python = server_python_override(env)
    settings = run_settings(config, [*server_python, *overrides])
    check_job_layout(settings, len(nodes), node_gpus(env))
    head_addr = node_address(nodes[0], env=env)
    port = ray_port(env)
    job = env.get("SLURM_JOB_ID", "0")
    out = settings["output_dir"]
    resume = has_checkpoint(out)
    # a per-job rollout API key when neither the config nor the job's environment has one (servers listen on the
    # node address, and then their admin endpoints need one): exported, so qarl preflight and qarl train read it
    # from their environment (utils/api_key.py), never from an argv that every user of the node can read
    api_key = settings["api_key"] or from_env(env) or secrets.token_hex(16)
    train = train_command(config, overrides, nodes=len(nodes), python=python, resume=resume,
                          server_python=server_python)
    return {
        "QARL_NODES": " ".join(nodes),
        "QARL_NNODES": str(len(nodes)),
        "QARL_HEAD_NODE": nodes[0],
        "QARL_HEAD_ADDR": head_addr,
        "QARL_RAY_PORT": str(port),
        "RAY_ADDRESS": f"{head_addr}:{port}",
        "QARL_RAY_TMPDIR": ray_tmpdir(env),
        "QARL_OUTPUT_DIR": out,
        "QARL_LOG_DIR": str(Path(out) / "slurm" / f"job-{job}"),
        "QARL_RESUME": "1" if resume else "0",
        **socket_env(head_addr, env),
        # for the job's log: what every rollout server starts with (launch/fleet.py server_interpreter)
        "QARL_SERVER_INTERPRETER": shlex.join([*settings["launch_prefix"], str(settings["server_python"] or python)]),
        "QARL_TRAIN": train,
        **({} if settings["api_key"] else {API_KEY_ENV: api_key}),
        "QARL_PREFLIGHT": preflight_command(train),
    }


def shell_assignments(values: Mapping[str, str | list[str]]) -> str:
    """Bash lines to ``eval``: ``export K=V`` for strings, ``K=( ... )`` arrays for lists."""
    lines = []
    for k, v in values.items():
        if isinstance(v, list):
            lines.append(f"{k}=({' '.join(shlex.quote(x) for x in v)})")
        else:
            lines.append(f"export {k}={shlex.quote(v)}")
    return "\n".join(lines)


def sbatch_command(config: str, overrides: Sequence[str], *, extra: Sequence[str] = (),
                   script: str | Path = SBATCH_SCRIPT) -> tuple[list[str], Path]:
    """(``sbatch`` argv, log folder) for a run: nodes and GPUs per node from the config, the job's output
    in ``<train.output_dir>/slurm/<job name>-<job id>.out`` (appended across requeues)."""
    s = run_settings(config, overrides)
    log_dir = Path(s["output_dir"]).resolve() / "slurm"
    name = "qarl-" + Path(config).stem
    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--nodes={s['nodes']}",
           f"--output={log_dir}/%x-%j.out"]
    if s["gpus_per_node"]:
        cmd.append(f"--gpus-per-node={s['gpus_per_node']}")
    return cmd + list(extra) + [str(script), config, *overrides], log_dir


# ------------------------------------------------------------------------------------------- commands
def _ray_node(args: argparse.Namespace) -> int:
    """One srun task per node: start this node's Ray (head on the first node) and block."""
    env = os.environ
    me = env.get("SLURMD_NODENAME") or socket.gethostname()
    head_node, head_addr, port = env["QARL_HEAD_NODE"], env["QARL_HEAD_ADDR"], int(env["QARL_RAY_PORT"])
    head = me == head_node
    addr = head_addr if head else node_address(me, env=env)
    if not head:
        wait_port(head_addr, port, args.timeout)
    child_env = {**env, **socket_env(addr, env)}
    ray = str(Path(sys.executable).with_name("ray"))
    cmd = ray_start_command(head=head, node_addr=addr, head_addr=head_addr, port=port,
                            num_cpus=node_cpus(env), num_gpus=node_gpus(env), temp_dir=env["QARL_RAY_TMPDIR"],
                            ray=ray if Path(ray).exists() else "ray")
    print(f"[{me}] {shlex.join(cmd)}", flush=True)
    if head:
        os.execvpe(cmd[0], cmd, child_env)
    return join_ray(cmd, child_env, head_up=lambda: port_open(head_addr, port), label=f"[{me}]")


# A worker's `ray start` gives up when its raylet has not registered with the head's GCS within 30 s (hard-coded in
# Ray 2.x, ray/_private/node.py: "The current node timed out during startup ... the GCS has become overloaded"),
# which happens on a loaded node; the job then waits for that node until wait-ray's timeout. So it is started again.
RAY_JOIN_TRIES = 3
RAY_JOIN_WINDOW_S = 180.0  # an exit later than this is not a failed start (the head went away): never retried


def port_open(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=5):
            return True
    except OSError:
        return False


def join_ray(cmd: Sequence[str], env: Mapping[str, str], *, head_up, label: str = "",
             tries: int = RAY_JOIN_TRIES, window_s: float = RAY_JOIN_WINDOW_S) -> int:
    """Run a worker node's ``ray start --block`` and return its exit code; a non-zero exit within ``window_s``
    of its start while ``head_up()`` still holds is a failed join, started again (``tries`` in all). SIGTERM and
    SIGINT (srun ending the task) are passed on, so ending the task still ends the node's Ray, and after one no
    start is retried."""
    import signal

    running: list[subprocess.Popen] = []
    told: list[int] = []

    def pass_on(signum, frame):
        told.append(signum)
        for proc in running:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(1, tries + 1):
            started = time.monotonic()
            running[:] = [subprocess.Popen(list(cmd), env=dict(env))]
            # unbounded by design: `ray start --block` lives as long as the job; Slurm's time limit and the
            # signals passed on above end it (docs/cluster.md, 'Every wait is bounded')
            rc = running[0].wait()
            took = time.monotonic() - started
            if rc == 0 or told or attempt == tries or took > window_s or not head_up():
                return rc
            print(f"{label} ray start exited with {rc} after {took:.0f} s while joining the head: starting it "
                  f"again (try {attempt + 1} of {tries})", flush=True)
            time.sleep(2)
        return rc
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_ray(args: argparse.Namespace) -> int:
    import ray

    ray.init(address=args.address or "auto", log_to_driver=False, configure_logging=False)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= args.nodes:
                print(f"ray: {len(alive)} nodes up: " + ", ".join(
                    f"{n['NodeManagerAddress']} (CPU {n['Resources'].get('CPU', 0):g}, GPU "
                    f"{n['Resources'].get('GPU', 0):g})" for n in alive), flush=True)
                return 0
            if time.monotonic() > deadline:
                raise UserError(f"only {len(alive)} of {args.nodes} Ray nodes up after {args.timeout:.0f} s")
            time.sleep(1)
    finally:
        ray.shutdown()


def _env(args: argparse.Namespace) -> int:
    print(shell_assignments(job_env(args.config, args.overrides)))
    return 0


def _submit(args: argparse.Namespace) -> int:
    cmd, log_dir = sbatch_command(args.config, args.overrides, extra=args.sbatch_arg)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"sbatch gave no answer within {SBATCH_TIMEOUT_S:g} s (slurmctld unreachable or "
                        "overloaded? scontrol ping); the job may or may not have been queued: see squeue") from None
    if proc.returncode:
        raise UserError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
    job = proc.stdout.strip().split(";")[0]
    print(f"submitted job {job}; log {log_dir}/qarl-{Path(args.config).stem}-{job}.out")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="sbatch slurm/qarl.sbatch for a config")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch command only")
    p.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch option (repeatable)")
    add_config_args(p, positional=True)
    p.set_defaults(func=_submit)
    p = sub.add_parser("env", help="(in the job) shell assignments for slurm/qarl.sbatch")
    add_config_args(p, positional=True)
    p.set_defaults(func=_env)
    p = sub.add_parser("ray-node", help="(one srun task per node) exec ray start for this node")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a worker waits for the head")
    p.set_defaults(func=_ray_node)
    p = sub.add_parser("wait-ray", help="wait until the Ray cluster has --nodes nodes")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--address", default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=_wait_ray)
    args = parse_args(parser, argv)
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"launch.slurm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
