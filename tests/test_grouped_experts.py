"""Grouped experts (moe/grouped.py, model.experts=grouped) against Megatron's SequentialMLP (issue 52): the same
log-probs, loss and gradients bit for bit, every scheme, fp32 and bf16, at TP1/EP1, TP2/EP2 and an expert-TP layout
(TP2/EP1), with uneven token counts and an expert that gets no token; dist-checkpoints that either writes, the other
resumes; the choice of implementation and its refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_qarl.errors import ConfigError, UserError
from megatron_qarl.moe.parallelize import init_parallel, run_ranks

SCHEMES = ("bf16", "w4a16", "w8a8_fp8", "w8a8_int8")


def _arch(experts: int = 8):
    from megatron_qarl.moe.model import Qwen3MoeArch

    return Qwen3MoeArch(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, num_experts=experts, num_experts_per_tok=2,
                        moe_intermediate_size=128, intermediate_size=256, rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=256, norm_topk_prob=True, tie_word_embeddings=False,
                        attention_bias=False)


def skewed_routes(arch, b: int, s: int, seed: int) -> torch.Tensor:
    """R3 routes [B, S, L, K]: expert 0 four times as likely as each of 1..E-2, the last expert never chosen."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.tensor([4.0] + [1.0] * (arch.num_experts - 2) + [0.0])
    picks = [torch.multinomial(weights, arch.num_experts_per_tok, generator=g)
             for _ in range(b * s * arch.num_hidden_layers)]
    return torch.stack(picks).view(b, s, arch.num_hidden_layers, arch.num_experts_per_tok)


def _by_hf_name(learner, what: str) -> dict[str, torch.Tensor]:
    """This rank's local tensor of every parameter map by its first Hugging Face name: the weight, or its gradient."""
    from megatron_qarl.moe.convert import Layout, model_impl, param_maps, param_tensor

    lay = Layout.current()
    params = {n: (p.main_grad if what == "grad" else p).detach() for n, p in learner.module.named_parameters()}
    return {pm.hf[0]: param_tensor(params, pm).clone()
            for pm in param_maps(learner.arch, lay.ep_rank, lay.ep, model_impl(learner.module))}


def _one_learner(arch, tp: int, ep: int, scheme: str, dtype, experts: str, tokens, routes) -> dict:
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner, token_mean_nll
    from megatron_qarl.qat.config import QuantConfig

    torch.manual_seed(0)  # SequentialMLP and GroupedExperts draw their experts alike (moe/grouped.py)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=1e-3, clip_grad=0.0), dtype=dtype,
                      quant=QuantConfig(scheme=scheme), experts=experts, routing_replay=True)
    out = {"logp": learner.logprobs(tokens).detach()}
    learner.model.zero_grad_buffer()
    logp = learner.logprobs(tokens, routes)
    out["logp_r3"], out["loss"] = logp.detach(), -logp.sum().detach()
    (-logp.sum()).backward()
    out |= {f"grad {k}": v for k, v in _by_hf_name(learner, "grad").items()}
    metrics = learner.train_step(dataclasses.replace(_batch(tokens), extra={"routes_BSLK": routes}),
                                 lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.numel()))
    out["grad_norm"] = torch.tensor(metrics["grad_norm"], dtype=torch.float64)
    out |= {f"stepped {k}": v for k, v in _by_hf_name(learner, "weight").items()}
    out["impl"] = type(learner.module.decoder.layers[0].mlp.experts).__name__
    return out


def _batch(tokens):
    from megatron_qarl.learner.rank import Batch

    return Batch(tokens, torch.ones(tokens.shape[0], tokens.shape[1] - 1))


def _compare(tp: int, ep: int) -> dict:
    init_parallel(tp=tp, ep=ep)
    arch = _arch()
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    routes = skewed_routes(arch, 2, 16, seed=1)
    report = {}
    for scheme in SCHEMES:
        for dtype in (torch.float32, torch.bfloat16):
            a, b = (_one_learner(arch, tp, ep, scheme, dtype, e, tokens, routes) for e in ("sequential", "grouped"))
            impls = a.pop("impl"), b.pop("impl")
            assert impls[0].endswith("SequentialMLP") and impls[1] == "GroupedExperts", impls
            norms = a.pop("grad_norm").item(), b.pop("grad_norm").item()
            differ = [k for k in a if not torch.equal(a[k], b[k])]
            report[(scheme, str(dtype))] = {"differ": differ, "norms": norms, "compared": len(a)}
    return report


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (2, 1)], ids=["tp1-ep1", "tp2-ep2", "tp2-ep1-expert-tp"])
def test_grouped_experts_give_sequentials_logprobs_loss_and_gradients_bit_for_bit(tp, ep):
    """Same seed, same weights: the log-probs (own routing, and replayed routes that leave an expert without tokens),
    the loss, every gradient and, after a train step without clipping, every weight; the grad norm sums the same
    gradients over differently shaped parameters (a stack vs one per expert), so it agrees to float rounding."""
    arch = _arch()
    routes = skewed_routes(arch, 2, 16, seed=1)
    counts = torch.bincount(routes[:, :, 0].reshape(-1), minlength=arch.num_experts)
    assert counts[-1] == 0 and len(set(counts[:-1].tolist())) > 1  # an idle expert, uneven loads
    for rank_report in run_ranks(max(tp, ep), _compare, tp, ep):
        for case, r in rank_report.items():
            assert r["differ"] == [], (case, r["differ"][:8])
            assert r["compared"] > 40
            a, b = r["norms"]
            assert abs(a - b) <= 1e-6 * abs(a), (case, r["norms"])


# ------------------------------------------------------------------------------------------------ checkpoints
def _train(learner, tokens):
    from megatron_qarl.learner.rank import token_mean_nll

    return learner.train_step(_batch(tokens), lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.numel()))


def _interchange(ep: int, path: str, scheme: str) -> dict:
    """A learner of each kind writes a checkpoint after a step (model-space optimizer) and takes another; a learner of
    the other kind, drawn from another seed, resumes it and takes the same step: its weights and loss must equal the
    writer's. A dp_reshardable checkpoint is refused by the other kind, naming the keys."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.checkpoint import load_learner, save_learner
    from megatron_qarl.learner.rank import Learner, weights_changed
    from megatron_qarl.qat.config import QuantConfig

    init_parallel(ep=ep)
    arch = _arch()
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def learner(experts: str, seed: int):
        torch.manual_seed(seed)
        return Learner(arch, ParallelConfig(ep=ep), OptimConfig(lr=1e-3, clip_grad=0.0),
                       quant=QuantConfig(scheme=scheme), experts=experts)

    out = {}
    for writer, reader in (("sequential", "grouped"), ("grouped", "sequential")):
        a = learner(writer, 0)
        _train(a, tokens)
        save_learner(f"{path}/{writer}", a.module, a.optimizer, "fully_reshardable")
        save_learner(f"{path}/{writer}-dp", a.module, a.optimizer, "dp_reshardable")
        step_a = _train(a, tokens)
        b = learner(reader, 1)
        load_learner(f"{path}/{writer}", b.module, b.optimizer)
        weights_changed(b)
        step_b = _train(b, tokens)
        wa, wb = _by_hf_name(a, "weight"), _by_hf_name(b, "weight")
        out[writer] = {"differ": [k for k in wa if not torch.equal(wa[k], wb[k])], "loss": (step_a["loss"],
                       step_b["loss"]), "meta": json.loads(open(f"{path}/{writer}/learner_meta.json").read())}
        try:
            load_learner(f"{path}/{writer}-dp", b.module, b.optimizer)
            out[writer]["dp"] = "loaded"
        except UserError as err:
            out[writer]["dp"] = str(err)
    return out


@pytest.mark.parametrize("ep, scheme", [(1, "bf16"), (1, "w4a16"), (2, "w4a16")])
def test_a_checkpoint_of_either_experts_resumes_under_the_other_bit_for_bit(tmp_path, ep, scheme):
    """bf16: Megatron's checkpoint keys with an expert axis; w4a16: ModelOpt's QuantSequentialMLP writes each expert
    under a key of its own (singleton_local_shards), which the grouped experts then write too."""
    for rank_report in run_ranks(ep, _interchange, ep, str(tmp_path), scheme):
        for writer, r in rank_report.items():
            assert r["differ"] == [] and r["loss"][0] == r["loss"][1], (writer, r)
            assert r["meta"] == {"model_impl": "local", "experts": writer, "optimizer_format": "fully_reshardable"}
            assert "train.checkpoint.optimizer_format=dp_reshardable" in r["dp"] and \
                f"resume with model.experts={writer}" in r["dp"], r["dp"]


def _sharded_keys(experts: str, ep: int, tp: int = 1, scheme: str = "bf16") -> dict:
    """(key, global shape, global offset) of every ShardedTensor a model's dist-checkpoint holds, and its objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from megatron_qarl.moe.model import build_model
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.modules import apply_fake_quant

    init_parallel(tp=tp, ep=ep)
    model = build_model(_arch(), tp=tp, ep=ep, experts=experts)
    if scheme != "bf16":  # ModelOpt's QuantSequentialMLP writes singleton keys, except at TP > 1 with EP > 1
        apply_fake_quant(model, _arch(), QuantConfig(scheme=scheme))
    sd = model.sharded_state_dict()
    for k, v in list(sd.items()):
        if isinstance(v, ShardedTensorFactory):
            sd[k] = v.build()
    tensors, objects = set(), set()
    stack = [sd]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, ShardedTensor):
            tensors.add((x.key, tuple(x.global_shape), tuple(x.global_offset), x.replica_id))
        elif isinstance(x, ShardedObject):
            objects.add((x.key, tuple(x.global_shape), tuple(x.global_offset)))
    return {"tensors": tensors, "objects": objects}


@pytest.mark.parametrize("ep, tp, scheme", [(1, 1, "bf16"), (2, 1, "bf16"), (2, 2, "w4a16")])
def test_grouped_experts_write_sequentials_checkpoint_keys(ep, tp, scheme):
    """What makes them interchangeable: the same ShardedTensors (key, global shape, offset, replica) and objects; for a
    quantized learner at TP 2 x EP 2, where ModelOpt keeps SequentialMLP a Megatron module (Megatron's keys with an
    expert axis) while at EP 1 its QuantSequentialMLP writes a key per expert."""
    world = max(tp, ep)
    seq = run_ranks(world, _sharded_keys, "sequential", ep, tp, scheme)
    grouped = run_ranks(world, _sharded_keys, "grouped", ep, tp, scheme)
    for a, b in zip(seq, grouped, strict=True):
        assert a["tensors"] == b["tensors"] and a["objects"] == b["objects"]
        assert any("experts.linear_fc1.weight" in k for k, *_ in a["tensors"])


# ------------------------------------------------------------------------------------------------ the choice
def test_auto_is_grouped_where_it_is_fast_and_grouped_is_refused_where_it_is_not(monkeypatch):
    from megatron_qarl.moe import grouped

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    kw = {"hidden": 2048, "ffn_per_rank": 768}
    assert grouped.resolve_experts("auto", impl="local", device=cpu, dtype=torch.float32, **kw) == "grouped"
    assert grouped.resolve_experts("sequential", impl="local", device=cpu, dtype=torch.float32, **kw) == "sequential"
    assert grouped.resolve_experts("auto", impl="te", device=cpu, dtype=torch.float32, **kw) == "te"
    with pytest.raises(ConfigError, match=r"^model\.experts: grouped .*model\.impl is te"):
        grouped.resolve_experts("grouped", impl="te", device=cpu, dtype=torch.float32, **kw)
    # sm_100: one kernel too, but a non-zero weight gradient for an expert without tokens (pytorch/pytorch#172439)
    for capability, dtype, fast in (((9, 0), torch.bfloat16, True), ((10, 0), torch.bfloat16, False),
                                    ((8, 0), torch.bfloat16, False), ((9, 0), torch.float32, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert grouped.resolve_experts("auto", impl="local", device=cuda, dtype=dtype, **kw) == \
            ("grouped" if fast else "sequential")
        if not fast:
            with pytest.raises(ConfigError, match=r"^model\.experts: grouped: .*copies the offsets to the host"):
                grouped.resolve_experts("grouped", impl="local", device=cuda, dtype=dtype, **kw)
    # torch's grouped matmul wants rows of a multiple of 16 bytes
    odd = {"hidden": 2048, "ffn_per_rank": 36}
    assert grouped.resolve_experts("auto", impl="local", device=cpu, dtype=torch.bfloat16, **odd) == "sequential"
    with pytest.raises(ConfigError, match=r"moe_intermediate_size / expert-TP = 36 elements of 2 bytes"):
        grouped.resolve_experts("grouped", impl="local", device=cpu, dtype=torch.bfloat16, **odd)


def test_model_experts_is_a_validated_key_and_te_takes_only_auto(tmp_path, tiny_model_dir):
    from megatron_qarl.preflight.rules import load_config

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model:\n  path: {tiny_model_dir}\n")
    assert load_config(cfg_file).model.experts == "auto"
    assert load_config(cfg_file, ["model.experts=sequential"]).model.experts == "sequential"
    with pytest.raises(ConfigError, match=r"^model\.experts: "):
        load_config(cfg_file, ["model.experts=fused"])
    with pytest.raises(ConfigError, match=r"model\.experts: grouped .*model\.impl is te"):
        load_config(cfg_file, ["model.experts=grouped", "model.impl=te"])


def test_a_stride0_gradient_and_an_empty_expert_go_through_the_grouped_matmul():
    """grouped_mm's backward refuses a stride-0 gradient (``y.sum().backward()``): the wrapper hands it a dense one."""
    from megatron_qarl.moe.grouped import grouped_linear

    x = torch.randn(7, 32, requires_grad=True)
    w = torch.randn(3, 16, 32, requires_grad=True)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)  # expert 1 gets no row
    grouped_linear(x, w, offs).sum().backward()
    assert torch.equal(w.grad[1], torch.zeros(16, 32))
    assert torch.equal(x.grad[:3], torch.ones(3, 16) @ w.detach()[0])
