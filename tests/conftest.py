"""Shared fixtures. Test tiers (markers): default = fast CPU unit tests; ``multiproc`` = several
gloo ranks; ``e2e`` = end-to-end CPU runs (the slowest; still run in CI); ``gpu`` = needs CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "checkpoints" / "tiny-qwen3-moe"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """A randomly initialised Qwen3-MoE with the tiny model's shapes but 2 layers (fast)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = tmp_path_factory.mktemp("random_moe")
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=128, intermediate_size=256, max_position_embeddings=128,
                         tie_word_embeddings=False, norm_topk_prob=True, rope_theta=10000.0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return str(out)
