"""slurm/qarl.sbatch on a REAL Slurm (slurmctld + two slurmd on this host, auth/none; Debian's packages, which
.ci/run installs): a two-node job runs `qarl preflight` on both nodes, starts Ray across both nodes, places the
learner and the rollout server on different nodes and trains; told USR1 (what --signal sends before the time limit)
it checkpoints, requeues itself, resumes on both nodes and COMPLETES. A job whose servers' environment runs another
NCCL than the learner's is stopped by preflight before anything starts, its report in the job's output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_qarl.launch.local_slurm import FINAL_STATES, LocalSlurm, missing_binaries
from megatron_qarl.moe.parallelize import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
MISSING = missing_binaries()
if MISSING:
    pytest.skip(f"Slurm is not installed here (missing {', '.join(MISSING)}); .ci/run installs it with apt-get "
                f"(slurmctld slurmd slurm-client)", allow_module_level=True)

# the CPU config, small: 4 prompts x 4 samples, a short held-out set, a checkpoint every step
SMALL = ["train.prompts_per_step=4", "rollout.sampling.n_samples=4", "train.eval.n=8", "train.eval.sampled_n=1",
         "train.eval.every=0", "rollout.max_batch_size=32", "train.checkpoint.every=1",
         "rollout.sampling.max_new_tokens=40", "rollout.startup_timeout_s=180",
         "rollout.threads=1"]  # one torch thread per server: less OpenMP thrash beside the learner on 2 cores


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2)
    cluster.start(timeout_s=120)
    yield cluster
    cluster.stop()


@pytest.fixture
def ray_tmp():
    path = tempfile.mkdtemp(prefix="qr", dir="/tmp")  # short: Ray's socket paths live under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _submit(slurm: LocalSlurm, config: str, overrides: list[str], ray_tmp: str,
            env: dict[str, str] | None = None) -> str:
    """``python -m launch.slurm submit`` as a user would; returns the job id."""
    job_env = {**slurm.env, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               "QARL_PYTHON": sys.executable, "QARL_RAY_PORT": str(free_port()), "QARL_RAY_TMPDIR": ray_tmp,
               "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "launch.slurm", "submit", config, *overrides], env=job_env,
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()[2].rstrip(";")


def _log(out: Path, job: str) -> str:
    (log,) = (out / "slurm").glob(f"*-{job}.out")
    return log.read_text(errors="replace")


def _steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "loss/loss" in r]


def test_two_node_job_runs_ray_across_nodes_checkpoints_on_usr1_requeues_and_resumes(slurm, tmp_path, ray_tmp):
    """One job (two jobs' worth of Slurm and Ray start-up saved): two nodes, Ray across both, the learner and the
    rollout server on different nodes; then USR1 (what `#SBATCH --signal=B:USR1@300` sends before the time limit)
    after step 1's checkpoint: the run stops with a checkpoint, the job requeues itself, restarts on both nodes and
    resumes to the end, each step once."""
    out = tmp_path / "run"
    # the servers' own environment, passed as the job's QARL_SERVER_PYTHON: an interpreter that records its argv
    server_env = tmp_path / "server-env"
    server_env.mkdir()
    python = server_env / "python"
    python.write_text(f'#!/bin/bash\nprintf "%s\\n" "$0" "$@" > "{server_env}/argv.$$"\n'
                      f'printf "%s" "$QARL_API_KEY" > "{server_env}/key.$$"\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    # one Ray CPU per node: the learner rank and the rollout server cannot share a node
    job = _submit(slurm, "configs/cpu_default.yaml",
                  [f"train.output_dir={out}", "launch.nodes=2", "train.steps=3", *SMALL], ray_tmp,
                  env={"QARL_RAY_NUM_CPUS": "1", "QARL_SERVER_PYTHON": str(python)})
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 900
    keys: set[str] = set()
    on_argv: list[str] = []  # every process's argv while the run is up: none may hold the job's API key
    while not (latest.is_file() and latest.read_text().strip() == "step_000001"):
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING"), _log(out, job)[-6000:]
        assert time.monotonic() < deadline, "no checkpoint after 900 s"
        keys |= {k for p in server_env.glob("key.*") if (k := p.read_text())}
        on_argv += [a for a in _every_argv() if any(k in a for k in keys)]
        time.sleep(0.2)
    assert len(keys) == 1 and len(next(iter(keys))) == 32, keys  # the job's key reached the server's environment
    assert not on_argv, f"the API key on a command line: {on_argv[:3]}"
    slurm.run(["scancel", "--signal=USR1", "--batch", job])
    while (info := slurm.job(job)).get("Restarts", "0") == "0" or info.get("JobState") == "COMPLETING":
        assert info.get("JobState") not in FINAL_STATES, f"{info}\n{_log(out, job)[-6000:]}"  # it requeues itself
        assert time.monotonic() < deadline, "not requeued"
        time.sleep(0.3)
    # Slurm holds a requeued job back until the killed run's credential has expired (EligibleTime): the test
    # cluster sets AuthInfo=cred_expire=10 (120 s by default). Forcing StartTime=now sooner fails the job
    # ("Job credential revoked"), which is what real clusters protect against too.
    info = slurm.wait(job, timeout_s=900)
    log = _log(out, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log[-6000:]}"
    first, resumed = log.split(f"job {job} restart 1 on q[1-2] (2 nodes)")
    # the first run: Ray on both nodes, learner and server apart, the servers' own python
    assert f"job {job} restart 0 on q[1-2] (2 nodes)" in first
    assert "ray: 2 nodes up: " in first and "127.0.0.2" in first and "127.0.0.3" in first
    placed = next(line for line in first.splitlines() if line.startswith("ray: learner ranks on "))
    learner, servers = placed.removeprefix("ray: learner ranks on ").split("; rollout servers on ")
    assert {learner, servers} == {"127.0.0.2", "127.0.0.3"}, placed
    assert "step 1/3 reward=" in first, first[-4000:]
    assert f"rollout servers run on: {python}" in first
    # preflight ran first, on both nodes (srun --label: task 0 and 1), and passed there
    assert first.index("preflight: all 10 checks passed") < first.index("ray: 2 nodes up: ")
    assert {ln.split(":")[0] for ln in first.splitlines() if ln.endswith("preflight: all 10 checks passed")} == \
        {"0", "1"}
    runs = [p.read_text().splitlines() for p in server_env.glob("argv.*")]
    key = next(iter(keys))
    assert not any(key in a for run in runs for a in run) and key not in log  # the servers' argv, the job's log
    assert key not in (out / "config.yaml").read_text()  # never written out with the config
    assert [str(python), "-m", "megatron_qarl.cli", "serve"] in [a[:4] for a in runs], runs
    # USR1: a checkpoint, exit 75, the job requeues itself; the restart resumes and completes
    assert info["Restarts"] == "1", info
    assert "got SIGUSR1" in first and "qarl train: stopped on a signal after step" in first
    assert "qarl train exited with 75" in first and f"requeueing job {job}" in first
    assert "resume: 1" in resumed and "--resume" in resumed and "ray: 2 nodes up: " in resumed
    assert "step 3/3 reward=" in resumed and "qarl train exited with 0" in resumed
    assert _steps(out) == [1, 2, 3]  # each step once: the resumed run continued after the checkpoint
    assert latest.read_text().strip() == "step_000003"
    assert sorted(p.name for p in (out / "slurm" / f"job-{job}").glob("ray-node*.log")) == \
        ["ray-node0.log", "ray-node1.log"]


def _every_argv() -> list[str]:
    """The command line of every process on this machine (what ``ps`` shows any user)."""
    argvs = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argvs.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # ended meanwhile
            pass
    return argvs


def _records(folder: Path, name: str, version: str) -> Path:
    """A folder holding one distribution record as pip writes it (importlib.metadata reads it on sys.path)."""
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


def test_a_job_whose_environments_run_two_nccls_is_stopped_by_preflight(slurm, tmp_path, ray_tmp):
    """Issue 29 item 2 at the job level: the learner's environment holds nvidia-nccl-cu13 2.29.7 (torch 2.13.0's
    pin), the servers' 2.30.7 (torch 2.14.1's, SGLang 0.5.23's). The job's preflight refuses the run on its node,
    naming both environments, the key and the fix, and the job ends (exit 4) before Ray or qarl train start."""
    out = tmp_path / "run"
    server_site = _records(tmp_path / "server-site", "nvidia-nccl-cu13", "2.30.7")
    python = tmp_path / "server-env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/bash\nexport PYTHONPATH={server_site}:{REPO}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    learner_site = _records(tmp_path / "learner-site", "nvidia-nccl-cu13", "2.29.7")
    job = _submit(slurm, "configs/cpu_default.yaml", [f"train.output_dir={out}", *SMALL], ray_tmp,
                  env={"QARL_SERVER_PYTHON": str(python), "PYTHONPATH": f"{learner_site}:{REPO}"})
    info = slurm.wait(job, timeout_s=600)
    log = _log(out, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "4:0", f"{info}\n{log[-6000:]}"
    report = log[log.index("preflight on every node: "):]
    assert "0: qarl preflight configs/cpu_default.yaml on " in report
    assert f"FAIL  NCCL [rollout.server_python; learner {sys.executable}, servers {python}]" in report
    assert "learner" in report and "2.29.7 (installed nvidia-nccl-cu13==2.29.7)" in report
    assert f"servers {python}: 2.30.7 (installed nvidia-nccl-cu13==2.30.7)" in report
    assert f"in learner {sys.executable}: {sys.executable} -m pip install --no-deps nvidia-nccl-cu13==2.30.7" in report
    assert "0: preflight: 1 problem of 10 checks: the run would fail" in report
    assert "preflight refused this run (the report above): nothing was started" in report
    assert "ray: " not in log and "qarl train exited" not in log and not (out / "metrics.jsonl").exists()
