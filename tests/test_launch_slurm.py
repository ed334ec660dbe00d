"""megatron_qarl/launch/slurm.py, the Python side of slurm/qarl.sbatch, without Slurm: node lists, node addresses,
the Ray start command of each node, the interface variables, the job's environment and `qarl train` command (with
--resume when the run has a checkpoint), and the sbatch command of `submit`."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_qarl.errors import UserError
from megatron_qarl.launch import slurm

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("nodelist", "names"), [
    ("n1", ["n1"]),
    ("q[1-2]", ["q1", "q2"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("a[009-011]", ["a009", "a010", "a011"]),
])
def test_expand_nodelist(nodelist, names):
    assert slurm.expand_nodelist(nodelist) == names


def test_expand_nodelist_rejects_garbage():
    with pytest.raises(ValueError, match="bad range"):
        slurm.expand_nodelist("n[a-b]")
    with pytest.raises(ValueError, match="backwards"):
        slurm.expand_nodelist("n[5-2]")
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST is not set"):
        slurm.job_nodes({})


def test_node_address_reads_nodeaddr_and_resolves(monkeypatch):
    line = ("NodeName=q2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=127.0.0.3 NodeHostName=q2 "
            "Version=22.05.8 State=IDLE")
    assert slurm.parse_scontrol_node(line)["NodeAddr"] == "127.0.0.3"

    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    monkeypatch.setattr(slurm.shutil, "which", lambda name, path=None: "/usr/bin/scontrol")
    assert slurm.node_address("q2") == "127.0.0.3"
    monkeypatch.setattr(slurm.shutil, "which", lambda name, path=None: None)  # no scontrol: resolve the name
    assert slurm.node_address("localhost") == "127.0.0.1"
    with pytest.raises(UserError, match="cannot resolve"):
        slurm.node_address("no-such-node.invalid")


def test_socket_env_names_the_interface_unless_set():
    assert slurm.interface_of("127.0.0.3") == "lo"
    assert slurm.socket_env("127.0.0.2", {}) == {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    assert slurm.socket_env("127.0.0.2", {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert slurm.interface_of("203.0.113.77") is None  # an address no interface here holds


def test_resources_ports_and_tmpdir_from_the_slurm_environment():
    assert slurm.node_gpus({"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert slurm.node_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 4
    assert slurm.node_gpus({}) == 0
    assert slurm.node_cpus({"QARL_RAY_NUM_CPUS": "1", "SLURM_CPUS_ON_NODE": "64"}) == 1
    assert slurm.node_cpus({"SLURM_CPUS_ON_NODE": "64"}) == 64
    assert slurm.ray_port({"SLURM_JOB_ID": "123456"}) == 20000 + 123456 % 20000
    assert slurm.ray_port({"QARL_RAY_PORT": "6390", "SLURM_JOB_ID": "7"}) == 6390
    assert slurm.ray_tmpdir({"SLURM_JOB_ID": "42"}) == "/tmp/qarl-ray-42"


def test_ray_start_commands():
    head = slurm.ray_start_command(head=True, node_addr="10.0.0.1", head_addr="10.0.0.1", port=20042, num_cpus=96,
                                   num_gpus=8, temp_dir="/tmp/qarl-ray-42")
    assert head[:3] == ["ray", "start", "--block"]
    assert {"--head", "--port=20042", "--ray-client-server-port=20043", "--node-ip-address=10.0.0.1",
            "--num-gpus=8", "--num-cpus=96", "--temp-dir=/tmp/qarl-ray-42", "--include-dashboard=false"} <= set(head)
    worker = slurm.ray_start_command(head=False, node_addr="10.0.0.2", head_addr="10.0.0.1", port=20042,
                                     num_cpus=96, num_gpus=8, temp_dir="/tmp/qarl-ray-42")
    assert "--address=10.0.0.1:20042" in worker and "--head" not in worker and "--node-ip-address=10.0.0.2" in worker


def test_train_command_and_resume(tmp_path):
    cmd = slurm.train_command("configs/x.yaml", ["train.steps=5"], nodes=2, python="py")
    assert cmd[:8] == ["py", "-m", "megatron_qarl.cli", "train", "--config", "configs/x.yaml", "--no-progress",
                       "--no-preflight"]  # every node has just run the whole preflight
    assert "--resume" not in cmd
    assert cmd[8:] == ["launch.backend=ray", "launch.ray_address=auto", "launch.master_addr=auto",
                       "launch.server_host=0.0.0.0", "launch.nodes=2", "train.steps=5"]
    assert "--resume" in slurm.train_command("c.yaml", [], nodes=1, resume=True)
    # every node's preflight checks the very run: same interpreter, config and overrides
    resumed = slurm.train_command("configs/x.yaml", ["train.steps=5"], nodes=2, python="py", resume=True)
    assert slurm.preflight_command(resumed) == ["py", "-m", "megatron_qarl.cli", "preflight", "--config",
                                                "configs/x.yaml", *cmd[8:]]
    assert not slurm.has_checkpoint(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000010\n")
    assert slurm.has_checkpoint(tmp_path)


def test_job_env_for_a_two_node_job(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(slurm, "node_address", lambda node, **kw: {"q1": "127.0.0.2", "q2": "127.0.0.3"}[node])
    out = tmp_path / "run"
    env = {"SLURM_JOB_NODELIST": "q[1-2]", "SLURM_JOB_ID": "17"}
    vals = slurm.job_env("configs/cpu_default.yaml", [f"train.output_dir={out}"], env, python="py")
    assert vals["QARL_NODES"] == "q1 q2" and vals["QARL_HEAD_NODE"] == "q1" and vals["QARL_NNODES"] == "2"
    assert vals["RAY_ADDRESS"] == f"127.0.0.2:{20017}" and vals["QARL_RAY_TMPDIR"] == "/tmp/qarl-ray-17"
    assert vals["QARL_LOG_DIR"] == str(out / "slurm" / "job-17") and vals["QARL_RESUME"] == "0"
    assert vals["GLOO_SOCKET_IFNAME"] == vals["NCCL_SOCKET_IFNAME"] == "lo"
    train = vals["QARL_TRAIN"]
    assert "--resume" not in train and "launch.nodes=2" in train
    assert vals["QARL_PREFLIGHT"] == slurm.preflight_command(train)
    # servers listen on 0.0.0.0: a key per job, in the environment (issue 38: before, rollout.api_key=<key> on
    # qarl train's and qarl preflight's argv, which /proc/*/cmdline shows every user of the node)
    key = vals["QARL_API_KEY"]
    assert len(key) == 32 and not any(key in a for a in [*train, *vals["QARL_PREFLIGHT"]])
    assert f"export QARL_API_KEY={key}" in slurm.shell_assignments(vals)
    assert slurm.job_env("configs/cpu_default.yaml", [f"train.output_dir={out}"], {**env, "QARL_API_KEY": "k" * 20},
                         python="py")["QARL_API_KEY"] == "k" * 20  # the submitter's own key is kept
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_000001")
    again = slurm.job_env("configs/cpu_default.yaml", [f"train.output_dir={out}", "rollout.api_key=mine"], env)
    assert again["QARL_RESUME"] == "1" and "--resume" in again["QARL_TRAIN"]
    assert "QARL_API_KEY" not in again  # the config's key is the run's


def test_gpu_config_must_match_the_allocation(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = "configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml"
    with pytest.raises(UserError, match=r"launch\.nodes: the config is laid out for 2 nodes, this Slurm job has 1"):
        slurm.job_env(cfg, [], {"SLURM_JOB_NODELIST": "gpu1", "SLURM_GPUS_ON_NODE": "8"})
    with pytest.raises(UserError, match=r"launch\.gpus_per_node: the config wants 8 GPUs per node, Slurm gave 4"):
        slurm.check_job_layout(slurm.run_settings(cfg, []), 2, 4)
    slurm.check_job_layout(slurm.run_settings(cfg, []), 2, 8)
    slurm.check_job_layout(slurm.run_settings("configs/cpu_default.yaml", []), 3, 0)  # CPU: any node count


def test_shell_assignments_eval_in_bash():
    text = slurm.shell_assignments({"A": "x y'z", "ARR": ["p q", "--flag", "k=v;rm"]})
    out = subprocess.run(["bash", "-c", text + '\nprintf "%s|" "$A" "${ARR[@]}" "${#ARR[@]}"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == "x y'z|p q|--flag|k=v;rm|3|"


def test_submit_command(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO)
    cmd, log_dir = slurm.sbatch_command("configs/qwen3-30b-a3b/w4a16_tbpo_4x8.yaml", [f"train.output_dir={tmp_path}"],
                                        extra=["--time=48:00:00"])
    assert cmd[:2] == ["sbatch", "--parsable"]
    assert {"--job-name=qarl-w4a16_tbpo_4x8", "--nodes=4", "--gpus-per-node=8", "--time=48:00:00",
            f"--output={tmp_path}/slurm/%x-%j.out"} <= set(cmd)
    assert cmd[-3:] == [str(REPO / "slurm" / "qarl.sbatch"), "configs/qwen3-30b-a3b/w4a16_tbpo_4x8.yaml",
                        f"train.output_dir={tmp_path}"]
    assert log_dir == tmp_path / "slurm"
    cpu, _ = slurm.sbatch_command("configs/cpu_default.yaml", ["launch.nodes=2"])
    assert "--nodes=2" in cpu and not any(a.startswith("--gpus-per-node") for a in cpu)
    assert slurm.main(["submit", "--dry-run", "configs/cpu_default.yaml"]) == 0
    assert capsys.readouterr().out.startswith("sbatch --parsable --job-name=qarl-cpu_default --nodes=1")


def test_the_launcher_users_run_from_the_repository_root(tmp_path):
    """``python -m launch.slurm`` (the top-level launch/ folder, not installed) reaches megatron_qarl.launch."""
    proc = subprocess.run([sys.executable, "-m", "launch.slurm", "submit", "--dry-run", "configs/cpu_default.yaml",
                           f"train.output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sbatch --parsable --job-name=qarl-cpu_default --nodes=1")


def test_qarl_slurm_runs_the_launchers_from_any_directory(tmp_path, capsys):
    """``qarl slurm submit`` (the installed command) from a directory outside the repository: the config's output
    directory is its own folder's (configs/../runs/...), a command-line one the current directory's; ``qarl slurm
    local-cluster`` reaches the one-host Slurm's parser."""
    from megatron_qarl import cli

    config = str(REPO / "configs" / "cpu_default.yaml")
    proc = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "slurm", "submit", "--dry-run", config,
                           "launch.nodes=2"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["sbatch", "--parsable", "--job-name=qarl-cpu_default", "--nodes=2",
                                   f"--output={REPO / 'runs' / 'cpu_default' / 'slurm'}/%x-%j.out",
                                   str(REPO / "slurm" / "qarl.sbatch"), config, "launch.nodes=2"]
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert cli.main(["slurm", "submit", "--dry-run", config, "train.output_dir=out"]) == 0
    finally:
        os.chdir(cwd)
    assert f"--output={tmp_path / 'out' / 'slurm'}/%x-%j.out" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.main(["slurm", "local-cluster", "--help"])
    assert done.value.code == 0 and "--root ROOT" in capsys.readouterr().out


def test_the_job_script_passes_sigusr2_on_to_qarl_train_and_lives_on(tmp_path):
    """slurm/qarl.sbatch's own USR2 trap (scancel --signal=USR2 --batch): the trainer gets it, the batch shell, whose
    default for USR2 is to end, goes on waiting for it."""
    trap = next(ln for ln in (REPO / "slurm" / "qarl.sbatch").read_text().splitlines() if ln.startswith("trap ")
                and ln.rstrip().endswith(" USR2"))
    got = tmp_path / "got"
    child = (f"import signal, time, pathlib; signal.signal(signal.SIGUSR2, lambda *a: pathlib.Path({str(got)!r})"
             f".write_text('usr2')); pathlib.Path({str(tmp_path / 'up')!r}).touch(); time.sleep(5)")
    script = (f"TRAIN_PID=''\n{trap}\n{shlex.quote(sys.executable)} -c {shlex.quote(child)} &\nTRAIN_PID=$!\n"
              "while true; do wait $TRAIN_PID; rc=$?; [ $rc -gt 128 ] && kill -0 $TRAIN_PID 2>/dev/null && continue; "
              "break; done\necho done $rc\n")
    shell = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "up").exists():
        assert shell.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR2)
    out, _ = shell.communicate(timeout=60)
    assert got.read_text() == "usr2" and out.strip() == "done 0", out


def test_sbatch_script_header_and_syntax():
    script = (REPO / "slurm" / "qarl.sbatch").read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@300", "#SBATCH --open-mode=append"):
        assert line in script
    assert "ray stop" not in script.replace("(no `ray stop`", "")  # it would stop every Ray on the host
    subprocess.run(["bash", "-n", str(REPO / "slurm" / "qarl.sbatch")], check=True)


def test_a_worker_nodes_failed_ray_join_is_started_again_while_the_head_is_up(tmp_path):
    """Ray 2.x's `ray start` gives up after 30 s when the loaded head's GCS does not register the node (seen in
    tests/test_slurm.py at load ~15: the job then waited for that node until wait-ray's timeout)."""
    from megatron_qarl.launch.slurm import join_ray

    marker = tmp_path / "tried"
    flaky = ["sh", "-c", f'if [ -f {marker} ]; then echo joined; exit 0; else touch {marker}; exit 1; fi']
    assert join_ray(flaky, os.environ, head_up=lambda: True) == 0
    marker.unlink()
    assert join_ray(flaky, os.environ, head_up=lambda: False) == 1  # the head is gone: the job is ending
    marker.unlink()
    assert join_ray(flaky, os.environ, head_up=lambda: True, window_s=0) == 1  # ran a while: not a failed start
    assert join_ray(["sh", "-c", "exit 3"], os.environ, head_up=lambda: True, tries=2) == 3


def test_ending_the_ray_node_task_ends_its_ray_and_starts_nothing_again(tmp_path):
    import signal
    import threading

    from megatron_qarl.launch.slurm import join_ray

    starts = tmp_path / "starts"
    node = ["sh", "-c", f"echo start >> {starts}; sleep 30"]  # a `ray start --block` that would run on
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # srun ending the task
    rc = join_ray(node, os.environ, head_up=lambda: True)
    assert rc == -signal.SIGTERM and starts.read_text().splitlines() == ["start"]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_submit_waits_for_sbatch_within_a_bound(monkeypatch, tmp_path, capsys):
    """Issue 53 item 5: ``submit`` waited on sbatch without a bound (sbatch itself waits on slurmctld). An sbatch
    that never answers (an unreachable controller, stood in for by a program that sleeps) now ends the submit with a
    UserError after SBATCH_TIMEOUT_S."""
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexec sleep 600\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "SBATCH_TIMEOUT_S", 2.0)
    monkeypatch.chdir(REPO)
    t0 = time.monotonic()
    assert slurm.main(["submit", "--config", "configs/cpu_default.yaml", f"train.output_dir={tmp_path}"]) == 2
    assert time.monotonic() - t0 < 30
    assert "sbatch gave no answer within 2 s" in capsys.readouterr().err
