"""The vLLM environment the vLLM tests use (scripts/make_vllm_env.sh makes it; CI runs that script), and a way to
run vLLM's own code in it (tests/vllm_judge.py). Imported by tests/test_vllm_*.py only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_qarl.rollout.vllm_launcher import EXTENSION_DIR

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("QARL_VLLM_PYTHON") or str(REPO / ".vllm-venv" / "bin" / "python")
HAVE_VLLM = Path(VLLM_PYTHON).is_file()
_skip = pytest.mark.skipif(
    not HAVE_VLLM, reason=f"no vLLM environment at {VLLM_PYTHON}: run scripts/make_vllm_env.sh (CI does), or set "
                          "QARL_VLLM_PYTHON to its python")


def needs_vllm(obj):
    """Mark a test (or fixture user) ``vllm`` and skip it, saying why, where the vLLM environment is absent."""
    return pytest.mark.vllm(_skip(obj))


def judge(tasks: list[dict], timeout_s: float = 600) -> list[dict]:
    """vLLM's answers to ``tasks`` (tests/vllm_judge.py says which), computed in the vLLM environment."""
    env = dict(os.environ, PYTHONPATH=str(EXTENSION_DIR), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run([VLLM_PYTHON, str(REPO / "tests" / "vllm_judge.py")], input=json.dumps(tasks),
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    marker = "@@JUDGE@@"
    if proc.returncode != 0 or marker not in proc.stdout:
        raise RuntimeError(f"vllm_judge.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.rsplit(marker, 1)[1])
