"""`qarl plan`: parameter counts and checkpoint bytes of Qwen3-30B-A3B against the published figures, the
byte counting against real exported checkpoints of the tiny model, layout validation, the learner and
rollout memory formulas, and the command's text and JSON output."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megatron_qarl import cli
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan import cli as plan_cli
from megatron_qarl.plan.memory import (
    GIB,
    LayoutError,
    LearnerLayout,
    ServerLayout,
    activation_bytes,
    check_learner_layout,
    check_server_layout,
    hf_tensors,
    kv_bytes_per_token,
    learner_local_params,
    learner_memory,
    param_counts,
    rollout_memory,
    rollout_weight_bytes,
)
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import iter_safetensors, quantize_checkpoint

REPO = Path(__file__).resolve().parents[1]
QWEN3_30B = REPO / "configs" / "models" / "qwen3-30b-a3b"
W4A16 = QuantConfig(scheme="w4a16")


@pytest.fixture(scope="module")
def big() -> Qwen3MoeArch:
    return Qwen3MoeArch.from_model_dir(QWEN3_30B)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Qwen3MoeArch:
    return Qwen3MoeArch.from_model_dir(tiny_model_dir)


def test_qwen3_30b_config_is_the_published_architecture(big):
    shape = (big.num_hidden_layers, big.hidden_size, big.num_attention_heads, big.num_key_value_heads)
    assert shape == (48, 2048, 32, 4)
    assert (big.head_dim, big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size) == (128, 128, 8, 768)
    assert (big.vocab_size, big.rope_theta, big.max_position_embeddings) == (151936, 1e6, 40960)
    assert not big.tie_word_embeddings and big.rms_norm_eps == 1e-6


@pytest.mark.parametrize(("scheme", "published_gib"), [("bf16", 56.88), ("w4a16", 16.89)])
def test_rollout_weights_match_published_figures(big, scheme, published_gib):
    gib = rollout_weight_bytes(big, QuantConfig(scheme=scheme)) / GIB
    assert abs(gib - published_gib) / published_gib < 0.02, f"{scheme}: {gib:.2f} GiB vs published {published_gib}"


def test_w4a16_counting_needs_bf16_rest_and_scales(big):
    """Why the 16.89 GiB figure pins the counting: dropping the BF16 non-expert tensors or the scales misses it."""
    p = param_counts(big)
    packed = p["experts"] / 2
    rest = (p["total"] - p["experts"]) * 2
    full = rollout_weight_bytes(big, W4A16)
    scales = full - packed - rest - 8 * 3 * big.num_experts * big.num_hidden_layers  # minus weight_shape tensors
    assert scales == 2 * p["experts"] // 128  # one bf16 scale per group of 128 weights
    assert abs((packed + rest) / GIB - 16.89) / 16.89 > 0.02
    assert abs((packed + scales) / GIB - 16.89) / 16.89 > 0.02
    zero_points = rollout_weight_bytes(big, QuantConfig(scheme="w4a16", symmetric=False)) - full
    assert zero_points == p["experts"] // 128 // 2  # one int4 zero point per group: the 0.10 GiB left to 16.89


def test_param_counts_qwen3_30b(big):
    p = param_counts(big)
    assert abs(p["total"] / 30.5e9 - 1) < 0.01  # "30.5B total"
    assert abs(p["active"] / 3.3e9 - 1) < 0.03  # "3.3B activated"
    h, d, a, g = 2048, 128, 32, 4
    assert p["attention_per_layer"] == h * a * d * 2 + h * g * d * 2 + 2 * d
    assert p["experts"] == 48 * 128 * 3 * h * 768
    assert p["embedding"] == p["lm_head"] == 151936 * h
    parts = ("embedding", "lm_head", "attention", "router", "experts", "norms")
    assert sum(p[k] for k in parts) == p["total"]
    assert p["active"] == p["total"] - p["experts"] * 120 // 128


def test_tensors_and_bf16_bytes_equal_the_tiny_checkpoint(tiny, tiny_model_dir):
    real = {name: t for name, t in iter_safetensors(tiny_model_dir)}
    assert {t.name: t.shape for t in hf_tensors(tiny)} == {n: tuple(t.shape) for n, t in real.items()}
    assert rollout_weight_bytes(tiny, QuantConfig()) == sum(t.numel() * 2 for t in real.values())
    elem = {t.element_size() for t in real.values()}.pop()  # the committed checkpoint is stored in one dtype
    assert rollout_weight_bytes(tiny, QuantConfig(), elem) == sum(t.numel() * elem for t in real.values())


@pytest.mark.parametrize(
    ("scheme", "symmetric"), [("w4a16", True), ("w4a16", False), ("w8a8_fp8", True), ("w8a8_int8", True)]
)
def test_quantized_bytes_equal_the_exported_checkpoint(tiny, tiny_model_dir, tmp_path, scheme, symmetric):
    out = quantize_checkpoint(tiny_model_dir, scheme, tmp_path / scheme, symmetric=symmetric)
    tensors = dict(iter_safetensors(out))
    real = sum(t.numel() * t.element_size() for t in tensors.values())
    passthrough = {t.element_size() for n, t in tensors.items() if n.endswith("norm.weight")}.pop()
    assert rollout_weight_bytes(tiny, QuantConfig(scheme=scheme, symmetric=symmetric), passthrough) == real


def test_learner_layouts_rejected_with_a_reason(big):
    with pytest.raises(LayoutError, match=r"ep=3 does not divide the 128 experts"):
        learner_memory(big, W4A16, LearnerLayout(gpus=24, tp=1, ep=3), micro_batch_tokens=1024)
    with pytest.raises(LayoutError, match=r"tp=8 must divide .* 4 KV groups"):
        check_learner_layout(big, LearnerLayout(gpus=16, tp=8, ep=2))
    with pytest.raises(LayoutError, match=r"multiple of tp=4 and of ep\*etp=16"):
        check_learner_layout(big, LearnerLayout(gpus=8, tp=4, ep=16))


def test_server_layouts_rejected_with_a_reason(big):
    with pytest.raises(LayoutError, match=r"ep=6 does not divide the 128 experts"):
        check_server_layout(big, W4A16, ServerLayout(tp=6, ep=6))
    with pytest.raises(LayoutError, match=r"ep must divide tp"):
        check_server_layout(big, W4A16, ServerLayout(tp=2, ep=4))
    with pytest.raises(LayoutError, match=r"768/4 is not a multiple of the w4a16 group/block 128"):
        check_server_layout(big, W4A16, ServerLayout(tp=4, ep=1))
    check_server_layout(big, QuantConfig(), ServerLayout(tp=4, ep=1))  # BF16 experts split anywhere
    check_server_layout(big, QuantConfig(scheme="w8a8_int8"), ServerLayout(tp=8, ep=1))  # per channel


def test_learner_memory_formulas(big):
    lay = LearnerLayout(gpus=16, tp=4, ep=8)
    assert (lay.etp, lay.dp, lay.edp, lay.sp) == (1, 4, 2, True)
    full = learner_memory(big, QuantConfig(), lay, micro_batch_tokens=8192, distributed_optimizer=False)
    dist = learner_memory(big, QuantConfig(), lay, micro_batch_tokens=8192)
    assert full["gradients"] == pytest.approx(2 * full["weights"], abs=2)
    assert full["optimizer"] == pytest.approx(6 * full["weights"], abs=6)
    assert dist["optimizer"] < full["optimizer"] / 2 and full["qat_cache"] == 0
    qat = learner_memory(big, W4A16, lay, micro_batch_tokens=8192)
    local_experts = param_counts(big)["experts"] / 8
    assert qat["qat_cache"] == pytest.approx(3 * local_experts + 2 * local_experts / 128, rel=1e-5)  # + shapes
    assert qat["total"] == sum(v for k, v in qat.items() if k != "total")
    assert activation_bytes(big, lay, 8192, recompute="full") < activation_bytes(big, lay, 8192) / 4
    assert activation_bytes(big, lay, 16384) == pytest.approx(2 * activation_bytes(big, lay, 8192), rel=1e-6)


def test_unfused_attention_keeps_the_scores_and_recompute_drops_them(big):
    """The local spec's s^2 term: 6 B per score element in each of the L layers plus one layer's transient 6 B,
    a^2-free and linear in the sequence length at fixed tokens; selective recompute keeps the scores of one layer
    only (while it recomputes), flash attention none."""
    lay, tokens = LearnerLayout(gpus=8, tp=4, ep=8), 9216
    per_score = tokens * big.num_attention_heads / lay.tp  # score elements per token of sequence length
    long, short = (activation_bytes(big, lay, tokens, seq_len=s, attention="unfused") for s in (9216, 4608))
    rope = big.num_hidden_layers * 8 * big.head_dim * 4608  # rotary cos / sin: per position
    assert long - short == pytest.approx((big.num_hidden_layers + 1) * 6 * per_score * 4608 + 9216**2 - 4608**2
                                         + rope, abs=2)
    flash = {r: activation_bytes(big, lay, tokens, recompute=r) for r in ("none", "selective", "full")}
    unfused = {r: activation_bytes(big, lay, tokens, attention="unfused", recompute=r)
               for r in ("none", "selective", "full")}
    assert flash["selective"] == flash["none"] > flash["full"]  # flash keeps no scores to drop
    assert unfused["none"] > 5 * unfused["selective"] and unfused["selective"] > unfused["full"]
    assert unfused["selective"] - flash["selective"] > 2 * 6 * per_score * tokens  # one layer's scores + work
    chunks = activation_bytes(big, lay, tokens, attention="unfused", recompute="full", recompute_num_layers=4)
    assert chunks > unfused["full"]  # a 4-layer chunk being recomputed holds 4 layers' activations
    sdpa = {r: activation_bytes(big, lay, tokens, attention="sdpa", recompute=r) for r in ("none", "selective")}
    sdpa_short = activation_bytes(big, lay, tokens, seq_len=4608, attention="sdpa")
    assert sdpa["none"] - sdpa_short == pytest.approx(rope, abs=2)  # no s^2 term: the rotary tables only
    # issue 55: without recompute the sdpa core attention keeps less than selective recompute's checkpoint (q, k, v
    # with the fused qkv output they view, and the roped q, k), and far less than unfused with selective
    assert sdpa["none"] < sdpa["selective"] < unfused["selective"] - 6 * per_score * tokens
    with pytest.raises(ValueError, match="attention: 'bogus'"):
        activation_bytes(big, lay, tokens, attention="bogus")
    with pytest.raises(ValueError, match="recompute: True"):
        activation_bytes(big, lay, tokens, recompute=True)


def _saved_for_backward(arch: Qwen3MoeArch, tp: int, batch: int, seq: int, recompute: str, attention: str,
                        experts: str = "grouped") -> int:
    """Bytes of the tensors one rank's local-spec model with the core attention ``attention`` and the experts
    ``experts`` saves for its backward during a training forward in BF16 (torch's saved-tensor hooks; the parameters
    left out)."""
    import torch

    from megatron_qarl.moe.model import attention_mask, build_model
    from megatron_qarl.moe.parallelize import init_parallel

    init_parallel(tp=tp, seed=1)
    torch.manual_seed(0)
    model = build_model(arch, tp=tp, dtype=torch.bfloat16, recompute=recompute, attention=attention,
                        experts=experts)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(seq).expand(batch, seq), attention_mask(attention, seq))
    return sum(saved.values())


@pytest.mark.multiproc
@pytest.mark.parametrize(("tp", "recompute", "attention", "experts"),
                         [(1, "none", "unfused", "grouped"), (1, "selective", "unfused", "grouped"),
                          (2, "none", "unfused", "grouped"), (2, "selective", "unfused", "sequential"),
                          (1, "none", "sdpa", "grouped"), (2, "none", "sdpa", "grouped"),
                          (2, "selective", "sdpa", "grouped")])
def test_local_spec_activations_are_what_megatron_saves(big, tp, recompute, attention, experts):
    """``local_spec_activation_parts`` against the bytes Megatron's local spec really saves for the backward, on
    two layers of Qwen3-30B-A3B's widths (16 experts, a 1024-token vocabulary), sequence parallel at TP 2, with
    either core attention (sdpa: torch's CPU flash kernel). Only the token ids (8 B each) are not counted."""
    import dataclasses

    from megatron_qarl.moe.parallelize import run_ranks
    from megatron_qarl.plan.memory import local_spec_activation_parts

    arch = dataclasses.replace(big, num_hidden_layers=2, num_experts=16, vocab_size=1024)
    batch, seq = 2, 128
    got = run_ranks(tp, _saved_for_backward, arch, tp, batch, seq, recompute, attention, experts)
    parts = local_spec_activation_parts(arch, LearnerLayout(gpus=tp, tp=tp), batch * seq, seq_len=seq,
                                        selective=recompute == "selective", attention=attention)
    want = 2 * (parts["layer"] + parts["scores"]) + parts["mask"] + parts["final"]
    for rank_bytes in got:
        assert rank_bytes - want == pytest.approx(8 * batch * seq / tp, abs=8 * batch * seq), (rank_bytes, want)


def test_optimizer_offload_moves_the_shard_to_the_host(big):
    from megatron_qarl.plan.memory import optimizer_host_bytes, optimizer_shard_params

    lay = LearnerLayout(gpus=8, tp=4, ep=8)
    shard = optimizer_shard_params(big, lay)
    kw = {"micro_batch_tokens": 9216}
    on_gpu = learner_memory(big, W4A16, lay, **kw)
    assert on_gpu["optimizer"] == int(12 * shard)
    assert learner_memory(big, W4A16, lay, offload_fraction=1.0, **kw)["optimizer"] == 0
    assert learner_memory(big, W4A16, lay, offload_fraction=0.25, **kw)["optimizer"] == int(12 * shard * 0.75)
    assert optimizer_host_bytes(big, lay, 1.0) == int(16 * shard)  # fp32 master, m, v and the gradient copy
    dense, expert = learner_local_params(big, lay)
    assert shard == pytest.approx(dense / 2 + expert)  # dense DP 2, expert DP 1: the experts cannot shard
    with pytest.raises(ValueError, match="offload_fraction: optimizer CPU offload needs the distributed optimizer"):
        learner_memory(big, W4A16, lay, offload_fraction=1.0, distributed_optimizer=False, **kw)


def test_attention_follows_the_model_implementation_and_where_the_learner_runs():
    from types import SimpleNamespace

    from megatron_qarl.plan.layouts import learner_attention

    def cfg(impl, gpus, attention="auto"):
        return SimpleNamespace(model=SimpleNamespace(impl=impl, attention=attention), learner_on_gpus=gpus)

    assert learner_attention(cfg("te", False))[0] == "flash"
    assert learner_attention(cfg("local", True))[0] == "sdpa"  # issue 55: torch's fused attention on the local spec
    assert learner_attention(cfg("local", True, "unfused"))[0] == "unfused"
    assert learner_attention(cfg("auto", False))[0] == "sdpa"  # TE needs CUDA
    assert learner_attention(cfg("auto", True)) == ("flash", "model.impl=auto on GPUs: the TE spec, assuming "
                                                             "transformer_engine is installed there")
    assert learner_attention(cfg("auto", True), te_available=False)[0] == "sdpa"
    assert learner_attention(cfg("auto", True), te_available=True)[0] == "flash"
    # an explicit local-spec attention makes model.impl=auto build the local spec (moe.te.resolve_impl)
    assert learner_attention(cfg("auto", True, "unfused"), te_available=True)[0] == "unfused"
    assert learner_attention(cfg("auto", True, "sdpa"), te_available=True)[0] == "sdpa"


def test_rollout_kv_cache_and_pool(big):
    assert kv_bytes_per_token(big, 1) == 2 * 48 * 4 * 128 * 2
    assert kv_bytes_per_token(big, 4) == kv_bytes_per_token(big, 8) == 2 * 48 * 1 * 128 * 2  # replicated beyond g
    gpu = int(80 * GIB)
    mem = rollout_memory(big, W4A16, ServerLayout(tp=1), gpu_bytes=gpu, mem_fraction_static=0.8,
                         concurrent_seqs=16, seq_len=9216)
    assert mem.weights == rollout_weight_bytes(big, W4A16)
    assert mem.kv_pool == int(0.8 * gpu) - mem.weights
    assert mem.kv_tokens == mem.kv_pool // kv_bytes_per_token(big, 1)
    assert mem.fits and mem.fits_all == (mem.kv_pool >= 16 * 9216 * kv_bytes_per_token(big, 1))
    bf16 = rollout_memory(big, QuantConfig(), ServerLayout(tp=1), gpu_bytes=gpu, mem_fraction_static=0.7,
                          concurrent_seqs=16, seq_len=9216)
    assert not bf16.fits  # 56.9 GiB of BF16 weights leave no KV room in 70% of 80 GiB


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_holds_twice_the_tokens_of_the_same_pool(big, kv):
    """rollout.kv_cache_dtype: one byte per element (SGLang's uint8 pool) instead of bf16's two; the 30B W4A16
    layout's 46.93 GiB pool holds 512,551 bf16 tokens (55 full-length sequences), twice that in FP8."""
    from megatron_qarl.plan.layouts import PlanOptions, config_plan
    from megatron_qarl.preflight.rules import load_config

    gpu = int(80 * GIB)
    args = dict(gpu_bytes=gpu, mem_fraction_static=0.8, concurrent_seqs=16, seq_len=9216)
    bf16 = rollout_memory(big, W4A16, ServerLayout(tp=1), **args)
    fp8 = rollout_memory(big, W4A16, ServerLayout(tp=1), kv_cache_dtype=kv, **args)
    assert fp8.kv_pool == bf16.kv_pool and fp8.kv_tokens == fp8.kv_pool // (kv_bytes_per_token(big, 1) // 2)
    assert fp8.kv_needed * 2 == bf16.kv_needed
    path = REPO / "configs" / "qwen3-30b-a3b" / "w4a16_tbpo_2x8.yaml"
    plans = {d: config_plan(load_config(path, [f"rollout.kv_cache_dtype={d}"]), PlanOptions(), alternatives=False)
             for d in ("auto", kv)}
    assert (plans["auto"]["rollout"]["kv_tokens"], plans["auto"]["rollout"]["seqs_at_full_length"]) == (512551, 55)
    assert (plans[kv]["rollout"]["kv_tokens"], plans[kv]["rollout"]["seqs_at_full_length"]) == (1025102, 111)
    assert plans[kv]["rollout"]["kv_pool_gib"] == plans["auto"]["rollout"]["kv_pool_gib"] == 46.93


def _run_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="qarl")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_text_and_json(big, capsys):
    assert _run_plan(["plan", "--model", str(QWEN3_30B), "--nodes", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rollout_checkpoint_gib"] == {
        "bf16": round(rollout_weight_bytes(big, QuantConfig()) / GIB, 2),
        "w4a16": round(rollout_weight_bytes(big, W4A16) / GIB, 2),
    }
    (cluster,) = plan["clusters"]
    assert [p["placement"] for p in cluster["placements"]] == ["colocated", "split 1+1"]
    gpu = plan["config"]["cluster"]["gpu_gib"]
    for pl in cluster["placements"]:  # a layout fits when its peak phase and the GPU's fixed costs fit the GPU
        assert all(r["fits"] == (r["margin_gib"] >= 0) for r in pl["learner"])
        assert all(abs(r["peak_gib"] + r["fixed_gib"] + r["margin_gib"] - gpu) < 0.02 for r in pl["learner"])
        assert all(r["tp"] != 8 for r in pl["learner"])  # 4 KV groups: Megatron cannot use TP 8
        assert pl["fits"] == (any(r["fits"] for r in pl["learner"]) and any(r["fits"] for r in pl["rollout"]))
    assert _run_plan(["plan", "--model", str(QWEN3_30B), "--nodes", "2", "--scheme", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "rollout checkpoint: bf16 56.87 GiB" in text and "== 2 x 8 GPUs ==" in text
    assert "learner layouts that fit:" in text and "colocated: learner on 16 GPUs" in text
    assert ("learner: distributed optimizer on, no optimizer CPU offload, recompute none, attention flash "
            "(model.impl=auto on GPUs") in text
    assert _run_plan(["plan", "--model", str(QWEN3_30B), "--nodes", "2", "--recompute", "full", "--attention",
                      "unfused", "--no-distributed-optimizer", "--json"]) == 0
    what_if = json.loads(capsys.readouterr().out)
    assert what_if["config"]["learner"] | {"attention_why": ""} == {
        "distributed_optimizer": False, "offload_fraction": 0.0, "recompute": "full", "recompute_num_layers": 1,
        "attention": "unfused", "attention_why": "", "expert_imbalance": 1.0}


def test_cli_errors(tmp_path, capsys):
    assert cli.main(["plan", "--model", str(QWEN3_30B), "--scheme", "w3"]) == 2
    assert "--scheme: unknown scheme 'w3'" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(QWEN3_30B), "--mem-fraction-static", "1.5"]) == 2
    assert "--mem-fraction-static" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(QWEN3_30B), "--optimizer-cpu-offload", "--no-distributed-optimizer"]) == 2
    assert "--no-distributed-optimizer: optimizer CPU offload" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, runs", [
    (["rollout.sampling.temperature=0.7"], False),  # train.async off: no mismatch split, no forward at T = 1
    (["rollout.sampling.temperature=0.7", "train.async=one_step", "train.mismatch_split=true"], True),
    (["rollout.sampling.temperature=0.7", "train.async=one_step", "train.mismatch_split=false"], False),
    (["rollout.sampling.temperature=1.0", "train.async=one_step", "train.mismatch_split=true"], False),
])
def test_the_temperature_1_forward_is_planned_only_where_the_trainer_runs_it(overrides, runs):
    """train/trainer.py runs Learner.forward_logprobs(temperature=1.0) for the mismatch split only (train.async on,
    train.mismatch_split, a temperature other than 1); the planner counted it whenever the temperature was not 1,
    which set Qwen3-235B's peak (docs/plan.md) in a phase an async-off run never reaches."""
    from megatron_qarl.plan.phases import phases_of
    from megatron_qarl.preflight.rules import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "cpu_default.yaml", overrides)
    assert ("eval_forward" in [p.name for p in phases_of(cfg)]) is runs
