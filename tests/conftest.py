"""Shared fixtures. Test tiers (markers): default = fast CPU unit tests; ``multiproc`` = several
gloo ranks; ``e2e`` = end-to-end CPU runs (the slowest; still run in CI); ``gpu`` = needs CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_qarl.moe import parallelize

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "checkpoints" / "tiny-qwen3-moe"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# strict device mode (megatron_qarl/moe/parallelize.py): every tensor handed to a collective must have been placed
# on its group's device by to_group_device; spawned ranks and server processes inherit it
os.environ.setdefault("QARL_STRICT_DEVICES", "1")
# the suite starts hundreds of interpreters (servers, trainers, probes): let them cache the project's bytecode
# (__pycache__/ is ignored by git) rather than compile its modules again in each (about 0.5 s of CPU per process)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# most multi-rank tests quantize: each xdist worker's rank forkserver (parallelize.rank_context) imports ModelOpt
# once, instead of every quantized rank importing it again (about 12 s of CPU per process on these machines)
parallelize.RANK_PRELOAD.append("modelopt.torch.quantization")


# The files that take longest (the suite's --durations under README's command on a 2-core machine), longest first:
# xdist hands out whole files (--dist loadfile) in collection order, so these start first and the run does not end
# waiting on one of them (longest-processing-time-first scheduling). Every other file keeps its place after them.
LONGEST_FIRST = [
    "test_combinations.py", "test_vllm_server.py", "test_train_e2e.py", "test_slurm.py", "test_train_faults.py",
    "test_megatron_cpu.py", "test_qat_megatron.py", "test_learner.py",
    "test_sync_delta_server.py", "test_vllm_train.py", "test_repro_mini.py", "test_sync_server.py",
    "test_sync_payload.py", "test_simulated_device.py",
]


def machine_report() -> list[str]:
    """What the session ran on (pytest's header, issue 46): the CPU, the ISA flags that gate tests (torch's, vLLM's
    and oneDNN's kernels differ by them), the cores, and which optional environments were found."""
    import shutil

    from vllm_tools import VLLM_PYTHON

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")),
                     []))
    isa = " ".join(f"{f}={'yes' if f in flags else 'no'}"
                   for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"))
    slurm = shutil.which("slurmctld") or ("/usr/sbin/slurmctld" if Path("/usr/sbin/slurmctld").is_file() else None)
    found = {".vllm-venv": VLLM_PYTHON if Path(VLLM_PYTHON).is_file() else None, "Slurm": slurm,
             "cc": shutil.which("cc"), "c++": shutil.which("c++")}
    return [f"machine: {model}; {os.cpu_count()} cores (affinity {len(os.sched_getaffinity(0))}); "
            f"torch {torch.__version__}, AMX tiles per torch: {torch.cpu._is_amx_tile_supported()}",
            f"ISA: {isa}",
            "optional environments: " + ", ".join(f"{k} {v or 'MISSING'}" for k, v in found.items())]


def pytest_report_header(config):
    return machine_report()


def pytest_terminal_summary(terminalreporter):
    """The machine again at the end: README's command runs with -q, which leaves the header out."""
    terminalreporter.write_sep("-", "machine")
    for line in machine_report():
        terminalreporter.write_line(line)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep our order, not its fewest-tests-last one
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_smoke.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The project's committed tiny Qwen3-MoE checkpoint (made by scripts/make_tiny_model.py)."""
    assert (TINY_MODEL / "config.json").is_file(), f"{TINY_MODEL} missing: run scripts/make_tiny_model.py"
    return str(TINY_MODEL)


def _write_random_moe(out: Path) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=128, intermediate_size=256, max_position_embeddings=128,
                         tie_word_embeddings=False, norm_topk_prob=True, rope_theta=10000.0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return str(out)


def _private_tiny_copy(out: Path) -> str:
    """A private copy of the trained tiny checkpoint in ``out`` (a colleague may be re-training it in place).
    Fails when the checkpoint is missing: the rollout tests are meant for the trained model, and a random
    stand-in would let them pass for the wrong reason."""
    weights = TINY_MODEL / "model.safetensors"
    if not weights.is_file():
        pytest.fail(f"{weights} is missing: restore the committed checkpoint (git checkout -- "
                    f"checkpoints/{TINY_MODEL.name}) or rebuild it with scripts/make_tiny_model.py", pytrace=False)
    for f in TINY_MODEL.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


@pytest.fixture(scope="session")
def private_tiny_copy():
    """``private_tiny_copy(dir) -> str``: the rollout tests serve a copy of the tiny checkpoint."""
    return _private_tiny_copy


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """A randomly initialised Qwen3-MoE with the tiny model's shapes but 2 layers (fast)."""
    return _write_random_moe(tmp_path_factory.mktemp("random_moe"))
