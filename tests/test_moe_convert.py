"""Hugging Face <-> Megatron conversion for every TP/EP layout, checked against transformers."""

from __future__ import annotations

import pytest
import torch

from megatron_qarl.errors import UserError
from megatron_qarl.moe import verify
from megatron_qarl.moe.convert import (
    Layout,
    SafetensorsDir,
    hf_to_shard,
    param_maps,
    peer_expert_name,
    shards_to_hf,
)
from megatron_qarl.moe.model import Qwen3MoeArch, expert_tp

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.multiproc
@pytest.mark.parametrize("tp, ep, experts", [(*lay, "grouped") for lay in LAYOUTS] + [(2, 1, "sequential")])
def test_verify_tiny_model(tp, ep, experts, tiny_model_dir):
    report = verify.run(tiny_model_dir, tp, ep, batch=2, seq=32, experts=experts)
    assert report["max_abs_logit_diff"] <= 1e-4, report
    assert report["round_trip_exact"], report
    assert report["round_trip_tensors"] == len(SafetensorsDir(tiny_model_dir).keys())


@pytest.mark.parametrize("impl", ["local", "grouped", "te"])
@pytest.mark.parametrize("tp, ep", LAYOUTS + [(4, 1), (1, 4)])
def test_shard_split_and_merge_is_exact_without_processes(tp, ep, impl, random_model_dir):
    """Split every tensor for every rank, merge the shards back: identical tensors (pure functions), for the
    parameter names of both Megatron layer specs (tests/test_te_spec.py checks the names against Megatron)."""
    arch = Qwen3MoeArch.from_model_dir(random_model_dir)
    if arch.num_key_value_heads % tp:
        pytest.skip("layout does not divide the KV groups")
    hf = SafetensorsDir(random_model_dir)
    etp = expert_tp(tp, ep)
    rebuilt = {}
    for ep_rank in range(ep):
        maps = list(param_maps(arch, ep_rank, ep, impl))
        for pm in maps:
            size = etp if pm.split in ("fc1", "fc2") else tp
            shards = [hf_to_shard(pm, hf.__getitem__, arch, Layout(r, tp, ep_rank, ep, r, etp))
                      for r in range(size)]
            rebuilt.update(shards_to_hf(pm, shards, arch))
    assert sorted(rebuilt) == sorted(hf.keys())
    for name, tensor in rebuilt.items():
        assert torch.equal(tensor, hf[name]), name


def test_experts_carry_their_local_index_and_unknown_specs_are_refused(random_model_dir):
    arch = Qwen3MoeArch.from_model_dir(random_model_dir)
    for impl, fc1 in (("local", "mlp.experts.local_experts.3.linear_fc1.weight"),
                      ("te", "mlp.experts.linear_fc1.weight3"), ("grouped", "mlp.experts.linear_fc1.weight")):
        pm = next(p for p in param_maps(arch, 1, 2, impl)
                  if p.mcore == f"decoder.layers.0.{fc1}" and p.expert == 3)
        assert (pm.expert, pm.hf[0]) == (3, "model.layers.0.mlp.experts.7.gate_proj.weight")  # 3 + 1 * 4
        assert pm.stacked == (impl == "grouped")
        peer = peer_expert_name(pm.hf[1], pm, Layout(ep_rank=1, ep=2), 4, 0)  # the same slot on EP rank 0
        assert peer == "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(ValueError, match="impl: 'transformer_engine' is not one of"):
        next(param_maps(arch, impl="transformer_engine"))


def test_qkv_interleaving_puts_each_group_together(random_model_dir):
    arch = Qwen3MoeArch.from_model_dir(random_model_dir)
    hf = SafetensorsDir(random_model_dir)
    pm = next(p for p in param_maps(arch) if p.split == "qkv")
    qkv = hf_to_shard(pm, hf.__getitem__, arch, Layout())
    hd, q_per_group = arch.head_dim, arch.num_attention_heads // arch.num_key_value_heads * arch.head_dim
    rows = q_per_group + 2 * hd
    q, k = hf[pm.hf[0]], hf[pm.hf[1]]
    assert torch.equal(qkv[rows: rows + q_per_group], q[q_per_group: 2 * q_per_group])  # group 1's q heads
    assert torch.equal(qkv[q_per_group: q_per_group + hd], k[:hd])  # group 0's k


@pytest.mark.parametrize("tp, ep, message", [
    (3, 1, "--tp 3 must divide num_attention_heads"),
    (4, 1, "--tp 4 must divide num_attention_heads 4 and num_key_value_heads 2"),
    (1, 3, "--ep 3 must divide num_experts 8"),
    (0, 1, "--tp must be >= 1"),
])
def test_verify_rejects_impossible_layouts(tp, ep, message, tiny_model_dir):
    with pytest.raises(UserError, match=message):
        verify.run(tiny_model_dir, tp, ep)


def test_arch_errors_name_file_and_key(tmp_path):
    from megatron_qarl.errors import ConfigError

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 8,}')
    with pytest.raises(ConfigError, match=r"config.json: line 1: invalid JSON"):
        Qwen3MoeArch.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 8}')
    with pytest.raises(ConfigError, match=r"config.json: missing key 'vocab_size'"):
        Qwen3MoeArch.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="model_type is 'llama'"):
        Qwen3MoeArch.from_model_dir(tmp_path)
