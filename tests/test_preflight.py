"""``qarl preflight`` (megatron_qarl/preflight/): a run's environments checked before any weight loads.

Issue 29 items 2 and 3: the learner's torch 2.13.0 loads NCCL 2.29.7, SGLang 0.5.23's torch 2.14.1 NCCL 2.30.7, and
NCCL refuses a communicator whose members differ, so the first weight sync of such a run crashed; the ``gpu`` extra
asked a Transformer Engine outside megatron-core's tested range, and nothing checked the driver against torch's
CUDA 13 build. Here: the rules as functions of what each environment reports (against the installed megatron-core's
own METADATA), then ``qarl preflight`` on this machine: passing for configs/cpu_default.yaml and for a vLLM run
(.vllm-venv as the servers' environment, where the probe runs vLLM's own parser and our vLLM weight-transfer
backend's group join), and refusing, all at once and each naming key, environment and fix, environments whose
installed NCCL distributions differ, a Transformer Engine outside the range and a flag the server's own parser
rejects; ``qarl train`` refusing a missing server interpreter before it writes anything.

The differing environments are real: a folder of distribution records (``<name>-<version>.dist-info/METADATA``, what
pip writes) on the interpreter's sys.path, which importlib.metadata reads inside that interpreter as it reads pip's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_tools import VLLM_PYTHON, needs_vllm

from megatron_qarl import cli
from megatron_qarl.preflight.probe import proc_driver_version
from megatron_qarl.preflight.versions import (
    check_driver,
    check_nccl,
    check_te,
    driver_floor,
    megatron_te_requirement,
)

REPO = Path(__file__).resolve().parents[1]
CPU_DEFAULT = "configs/cpu_default.yaml"
CPU = {"torch": "2.13.0+cpu", "torch_cuda": None, "nccl_runtime": None, "nccl_packages": {}, "driver": None}


def cuda_env(nccl: str, driver: str | None = "580.65.06", runtime: bool = True) -> dict:
    """An environment's facts as a CUDA torch 2.13 reports them (preflight/probe.py ``facts``)."""
    return {"torch": "2.13.0", "torch_cuda": "13.0", "nccl_runtime": nccl if runtime else None,
            "nccl_packages": {"nvidia-nccl-cu13": nccl}, "driver": driver}


# ---------------------------------------------------------------------------------------- the rules
def test_nccl_rule_one_version_in_the_group():
    """Item 2: the learner's 2.29.7 and SGLang's 2.30.7 is refused, naming both, the key and the fix; torch's
    runtime NCCL is what counts where torch is a CUDA build; a CPU member is fine in a gloo group only."""
    bad = check_nccl({"learner": cuda_env("2.29.7"), "servers": cuda_env("2.30.7")}, "nccl", "rollout.server_python")
    assert bad.ok is False and bad.key == "rollout.server_python" and bad.env == "learner, servers"
    assert "learner: 2.29.7" in bad.detail and "servers: 2.30.7" in bad.detail and "Mismatched NCCL" in bad.detail
    assert "pip install --no-deps nvidia-nccl-cu13==2.29.7" in bad.fix
    # a package that says 2.30.7 under a torch that loaded 2.29.7: the runtime counts
    loaded = {**cuda_env("2.29.7"), "nccl_packages": {"nvidia-nccl-cu13": "2.30.7"}}
    assert check_nccl({"learner": cuda_env("2.29.7"), "servers": loaded}, "nccl", "k").ok
    assert check_nccl({"learner": cuda_env("2.29.7"), "servers": cuda_env("2.29.7", runtime=False)}, "nccl", "k").ok
    assert check_nccl({"learner": CPU, "servers": CPU}, "gloo", "k").ok
    assert check_nccl({"learner": CPU, "servers": cuda_env("2.30.7")}, "gloo", "k").ok
    lacking = check_nccl({"learner": cuda_env("2.29.7"), "servers": CPU}, "nccl", "rollout.server_python")
    assert lacking.ok is False and lacking.env == "servers" and lacking.key == "rollout.server_python"


def test_te_rule_reads_megatron_cores_own_range():
    """Item 3: the range is megatron-core's METADATA's (0.16.1: >=2.9.0a0,<2.12.0); 2.20.2, what the old
    ``transformer-engine[pytorch]>=2.4`` installs today, is refused, naming the fix; no TE passes unless
    model.impl is te."""
    megatron, req = megatron_te_requirement()
    assert megatron == "0.16.1" and str(req.specifier) == "<2.12.0,>=2.9.0a0" and "core_cu13" in req.extras
    assert check_te("2.11.0", megatron, req, "auto").ok and check_te("2.9.0", megatron, req, "te").ok
    for outside in ("2.20.2", "2.4.0", "2.12.0"):
        found = check_te(outside, megatron, req, "auto")
        assert found.ok is False and found.key == "model.impl" and found.env == "learner", outside
        assert 'transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0' in found.fix
    assert check_te(None, megatron, req, "auto").ok and not check_te(None, megatron, req, "te").ok


def test_driver_rule_cuda_13_needs_r580():
    """Item 3: torch 2.13's Linux wheel is a CUDA 13.0 build, which needs driver 580 or newer."""
    assert (driver_floor("13.0"), driver_floor("12.8"), driver_floor("11.8"), driver_floor("14.0")) == \
        (580, 525, 450, None)
    gpu = ["launch.gpus_per_node=8"]
    old = check_driver({"learner": cuda_env("2.29.7", driver="570.124.06")}, gpu)
    assert old.ok is False and "R580" in old.fix and "570.124.06" in old.detail and old.env == "learner"
    assert check_driver({"learner": cuda_env("2.29.7", driver="580.65.06")}, gpu).ok
    # an older branch on which torch did initialise CUDA and saw its GPUs: forward compatibility (cuda-compat)
    compat = check_driver({"learner": {**cuda_env("2.29.7", driver="570.124.06"), "gpus": 8}}, gpu)
    assert compat.ok and "forward compatibility" in compat.detail
    mixed = check_driver({"learner": {**cuda_env("2.29.7", driver="570.124.06"), "gpus": 8},
                          "servers": cuda_env("2.29.7", driver="570.124.06")}, gpu)
    assert mixed.ok is False and mixed.env == "servers"
    assert check_driver({"learner": CPU, "servers": CPU}, []).ok  # a CPU run: no CUDA, no driver
    cpu_torch = check_driver({"learner": CPU}, gpu)  # a GPU run on a CPU build of torch
    assert cpu_torch.ok is False and cpu_torch.key == "launch.gpus_per_node=8"
    # the driver as /proc/driver/nvidia/version says it (proprietary and open kernel modules)
    assert proc_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC "
                               "2024\nGCC version:  gcc version 12.2.0\n") == "550.54.15"
    assert proc_driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
                               "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 06:54:38 UTC 2025\n") == "580.65.06"
    no_driver = check_driver({"learner": cuda_env("2.29.7", driver=None)}, [])
    assert no_driver.ok and not check_driver({"learner": cuda_env("2.29.7", driver=None)}, gpu).ok


# ----------------------------------------------------------------------------------- qarl preflight
def site(folder: Path, **versions: str) -> Path:
    """A folder of distribution records as pip writes them, e.g. ``site(p, nvidia_nccl_cu13="2.30.7")``."""
    for name, version in versions.items():
        info = folder / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    return folder


def server_python(folder: Path, site_dir: Path) -> str:
    """The servers' own environment: this venv's interpreter with ``site_dir`` and this checkout on its path."""
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(f'#!/bin/bash\nexport PYTHONPATH={site_dir}:{REPO}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def preflight(*overrides: str, learner_site: Path | None = None) -> subprocess.CompletedProcess:
    path = f"{learner_site}:{REPO}" if learner_site else str(REPO)
    return subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "preflight", "--config", CPU_DEFAULT,
                           *overrides], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "PYTHONPATH": path})


def lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """The report's line of each check (with its fix line), by check name."""
    out, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith(("  ok    ", "  FAIL  ", "  skip  ")):
            current = line[8:].split(":")[0].split(" [")[0]
            out[current] = line
        elif line.startswith("        fix: ") and current:
            out[current] += "\n" + line
    return out


CHECKS = ["GPU memory plan", "learner's environment", "servers' environment", "NCCL", "transformer-engine",
          "CUDA driver", "server command", "weight-update round trip"]


@pytest.mark.e2e
def test_preflight_passes_the_cpu_default_run():
    proc = preflight()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = lines(proc)
    assert list(found) == CHECKS and all(line.startswith("  ok    ") for line in found.values()), proc.stdout
    assert "no NCCL in any environment: a gloo group" in found["NCCL"]
    assert "a gloo group of this process" in found["weight-update round trip"]
    assert "one bucket of 5 tensors (bfloat16, float32, int32, int8" in found["weight-update round trip"]
    assert "received identical (sha256)" in found["weight-update round trip"]
    assert "preflight: all 8 checks passed" in proc.stdout


@needs_vllm
@pytest.mark.e2e
def test_preflight_passes_a_vllm_run():
    """The servers' environment is .vllm-venv (no megatron_qarl): the probe imports vLLM there, vLLM's own parser
    takes the command, and the round trip's rank 1 joins through our vLLM weight-transfer backend's join_group."""
    proc = preflight("rollout.backend=vllm", f"rollout.server_python={VLLM_PYTHON}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = lines(proc)
    assert all(line.startswith("  ok    ") for line in found.values()), proc.stdout
    assert f"servers {VLLM_PYTHON}: python" in found["servers' environment"] and "imports vllm 0.32.0" in \
        found["servers' environment"]
    assert "arguments for rollout.backend=vllm accepted by the backend's own parser" in found["server command"]
    assert f"and servers {VLLM_PYTHON} (rank 1)" in found["weight-update round trip"]


@pytest.mark.e2e
def test_preflight_lists_every_problem_at_once_naming_key_environment_and_fix(tmp_path):
    """The learner's environment holds nvidia-nccl-cu13 2.29.7 (torch 2.13.0's pin) and transformer-engine 2.20.2,
    the servers' nvidia-nccl-cu13 2.30.7 (torch 2.14.1's, SGLang 0.5.23's), and the API key starts with a dash,
    which `qarl serve`'s parser (run in the servers' environment) takes for a flag: three problems in one report,
    exit 1; the rest (the gloo round trip among them) still passes."""
    learner = site(tmp_path / "learner-site", nvidia_nccl_cu13="2.29.7", transformer_engine="2.20.2")
    servers = server_python(tmp_path / "server-env", site(tmp_path / "server-site", nvidia_nccl_cu13="2.30.7"))
    proc = preflight(f"rollout.server_python={servers}", "rollout.api_key=-k3y", learner_site=learner)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = lines(proc)
    assert list(found) == CHECKS, proc.stdout
    failed = {name for name, line in found.items() if line.startswith("  FAIL  ")}
    assert failed == {"NCCL", "transformer-engine", "server command"}, proc.stdout
    assert f"[rollout.server_python; learner {sys.executable}, servers {servers}]" in found["NCCL"]
    assert f"learner {sys.executable}: 2.29.7 (installed nvidia-nccl-cu13==2.29.7)" in found["NCCL"]
    assert f"servers {servers}: 2.30.7 (installed nvidia-nccl-cu13==2.30.7)" in found["NCCL"]
    assert "fix: install the learner's NCCL in the servers' environment: <server python> -m pip install --no-deps " \
           "nvidia-nccl-cu13==2.29.7" in found["NCCL"]
    assert "[model.impl; learner]: 2.20.2 in the learner's environment is outside the range megatron-core 0.16.1 " \
           "is tested with transformer-engine<2.12.0,>=2.9.0a0" in found["transformer-engine"]
    assert f"[rollout.api_key; servers {servers}]" in found["server command"]
    assert "qarl serve: error: argument --api-key: expected one argument" in found["server command"]
    assert "received identical (sha256)" in found["weight-update round trip"]
    assert "preflight: 3 problems of 8 checks: the run would fail" in proc.stdout


def test_qarl_train_refuses_a_missing_server_python_before_writing_anything(tmp_path, capsys):
    """The cheap part of preflight runs in qarl train before anything is built; its report names the key."""
    out = tmp_path / "run"
    rc = cli.main(["train", "--config", str(REPO / CPU_DEFAULT), f"train.output_dir={out}",
                   f"rollout.server_python={tmp_path}/nowhere/bin/python"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists(), err
    assert "the run's environments are not ready (qarl preflight --config" in err
    assert f"FAIL  servers' environment [rollout.server_python; servers {tmp_path}/nowhere/bin/python]: " \
           f"rollout.server_python: '{tmp_path}/nowhere/bin/python' is not an executable file" in err
    assert "fix: install megatron_qarl" in err and "preflight: 1 problem of 4 checks" in err

