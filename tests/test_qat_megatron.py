"""Fake quantization inside the Megatron learner equals what the rollout engine is handed."""

from __future__ import annotations

import pytest
import torch
from quantized_checkpoint import load_quantized_checkpoint

from megatron_qarl.moe.convert import Layout, SafetensorsDir, hf_to_shard, load_hf_into_model
from megatron_qarl.moe.model import Qwen3MoeArch, build_model, forward_logits
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.moe.verify import world_size
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import dequantize_state_dict, export_state_dict
from megatron_qarl.qat.modules import apply_fake_quant


def handed_codes(fq) -> dict:
    """Hugging Face name -> the QuantizedWeight the weight sync reads (sync/payload.py: ``target_codes``)."""
    return {name: qw for t in fq.targets for name, qw in fq.target_codes(t).items()}


def forward_weight(t) -> torch.Tensor:
    """The weight the forward of target ``t`` multiplies: its ModelOpt weight quantizer applied to the master
    weight, as the quant module's forward does (no autograd)."""
    with torch.no_grad():
        return t.weight_quantizer(t.param).detach()


def _learner_vs_export(model_dir: str, scheme: str, tp: int, ep: int, offline: dict) -> dict:
    """On each rank: fake-quant shards used by the forward vs the dequantized export of the codes
    the forward handed over, and vs the offline `qarl quantize` checkpoint of the same weights."""
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep)
    model = build_model(arch, tp=tp, ep=ep)
    hf = SafetensorsDir(model_dir)
    load_hf_into_model(model, arch, hf)
    cfg = QuantConfig(scheme=scheme)
    fq = apply_fake_quant(model, arch, cfg)
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        forward_logits(model, tokens)
    qws = handed_codes(fq)
    exported, qcfg = export_state_dict({}, cfg, quantized=qws)
    deq = dequantize_state_dict(exported, qcfg, dtype=torch.float32)
    lay = Layout.current()
    differ_export = differ_offline = elements = 0
    for t in fq.targets:
        used = forward_weight(t)
        differ_export += (used != hf_to_shard(t.pm, deq.__getitem__, arch, lay)).sum().item()
        differ_offline += (used != hf_to_shard(t.pm, offline.__getitem__, arch, lay)).sum().item()
        elements += used.numel()
    return {"targets": len(fq.targets), "elements": elements, "differ_export": differ_export,
            "differ_offline": differ_offline, "quantized_names": sorted(qws)}


@pytest.fixture(scope="module")
def offline(tiny_model_dir, tmp_path_factory):
    from megatron_qarl.qat.export import quantize_checkpoint

    out = {}
    for scheme in ("w4a16", "w8a8_fp8", "w8a8_int8"):
        d = tmp_path_factory.mktemp(scheme)
        quantize_checkpoint(tiny_model_dir, scheme, d)
        out[scheme] = (str(d), {k: v.float() for k, v in load_quantized_checkpoint(d).items()})
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8_fp8", "w8a8_int8"])
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2)])
def test_learner_low_bit_weights_equal_the_export(scheme, tp, ep, tiny_model_dir, offline):
    results = run_ranks(world_size(tp, ep), _learner_vs_export, tiny_model_dir, scheme, tp, ep, offline[scheme][1])
    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    for r in results:
        assert r["targets"] > 0 and r["elements"] > 0
        assert r["differ_export"] == 0, r
        assert r["differ_offline"] == 0, r
    names = set().union(*(r["quantized_names"] for r in results))
    experts = {f"model.layers.{L}.mlp.experts.{e}.{p}_proj.weight" for L in range(arch.num_hidden_layers)
               for e in range(arch.num_experts) for p in ("gate", "up", "down")}
    if scheme == "w4a16":  # routed experts only
        assert names == experts
    else:  # attention and experts
        attn = {f"model.layers.{L}.self_attn.{p}_proj.weight" for L in range(arch.num_hidden_layers)
                for p in "qkvo"}
        assert names == experts | attn


def _w4a16_logits(model_dir: str, tp: int, ep: int) -> torch.Tensor:
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep)
    model = build_model(arch, tp=tp, ep=ep)
    load_hf_into_model(model, arch, SafetensorsDir(model_dir))
    apply_fake_quant(model, arch, QuantConfig(scheme="w4a16"))
    tokens = torch.randint(0, arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return forward_logits(model, tokens), tokens


@pytest.mark.multiproc
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2)])
def test_w4a16_logits_equal_transformers_on_the_dequantized_checkpoint(tp, ep, tiny_model_dir, offline):
    from transformers import AutoModelForCausalLM

    logits, tokens = run_ranks(world_size(tp, ep), _w4a16_logits, tiny_model_dir, tp, ep)[0]
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    deq = offline["w4a16"][1]
    state = {k: v for k, v in ref_model.state_dict().items()}
    missing = ref_model.load_state_dict({**state, **_fused_experts(deq, ref_model)}, strict=True)
    assert not missing.missing_keys
    with torch.no_grad():
        ref = ref_model(input_ids=tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=tokens).logits
    assert (logits - ref).abs().max().item() <= 1e-4
    assert (logits - plain).abs().max().item() > 1e-3  # quantization really changed the model


def _fused_experts(deq: dict, model) -> dict:
    """transformers 5 keeps experts fused in memory: gate_up_proj [E, 2F, H], down_proj [E, H, F]."""
    out = {}
    for key, value in model.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            n = value.shape[0]
            out[key] = torch.stack([torch.cat([deq[f"{prefix}{e}.gate_proj.weight"],
                                               deq[f"{prefix}{e}.up_proj.weight"]]) for e in range(n)])
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            out[key] = torch.stack([deq[f"{prefix}{e}.down_proj.weight"] for e in range(value.shape[0])])
    assert out, "no fused expert tensors found"
    return out


def _ste_grads(model_dir: str) -> tuple[dict, dict]:
    """Gradient at the master weight (fake quant on) vs gradient of the same loss taken at the
    fake-quant weight itself (weights set to their fake-quant values, quantization off)."""
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel()
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    grads = []
    for quantize in (True, False):
        model = build_model(arch)
        load_hf_into_model(model, arch, SafetensorsDir(model_dir))
        fq = apply_fake_quant(model, arch, QuantConfig(scheme="w4a16"))
        if not quantize:
            with torch.no_grad():
                for t in fq.targets:
                    t.param.copy_(forward_weight(t))
            fq.remove()
        forward_logits(model, tokens).logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "local_experts" in n})
    return grads[0], grads[1]


def test_straight_through_gradient_reaches_the_master_weight(tiny_model_dir):
    at_master, at_fq = run_ranks(1, _ste_grads, tiny_model_dir)[0]
    assert at_master.keys() == at_fq.keys() and at_master
    for name in at_master:
        assert torch.allclose(at_master[name], at_fq[name], rtol=1e-5, atol=1e-8), name


def _quant_module_types(model_dir: str, scheme: str) -> dict:
    """The learner's quantized linears: ModelOpt quant modules whose enabled quantizers run our backends."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.qat.modules import ACT_BACKEND, WEIGHT_BACKEND

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel()
    learner = Learner(arch, ParallelConfig(), OptimConfig(), quant=QuantConfig(scheme=scheme))
    out = {"types": set(), "weight_backends": set(), "act_backends": set(), "disabled": set()}
    for t in learner.fake_quant.targets:
        out["types"].add(type(t.module).__name__)
        out["weight_backends"].add((t.weight_quantizer.backend, t.weight_quantizer.is_enabled))
        out["act_backends"].add((t.input_quantizer.backend, t.input_quantizer.is_enabled))
    bound = {id(t.module) for t in learner.fake_quant.targets}
    for name, m in learner.module.named_modules():
        if hasattr(m, "weight_quantizer") and id(m) not in bound:
            assert not m.weight_quantizer.is_enabled and not m.input_quantizer.is_enabled, name
            out["disabled"].add(name.split(".")[-1])
    out["converted"] = {name.split(".")[-1] for name, m in learner.module.named_modules()
                        if hasattr(m, "weight_quantizer")}
    out["mro"] = {c.__module__.split(".")[0] for t in learner.fake_quant.targets for c in type(t.module).__mro__}
    out["names"] = (WEIGHT_BACKEND, ACT_BACKEND)
    return out


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8_fp8"])
def test_quantized_linears_are_modelopt_quant_modules_on_our_backend(scheme, tiny_model_dir):
    r = run_ranks(1, _quant_module_types, tiny_model_dir, scheme)[0]
    weight_backend, act_backend = r["names"]
    # the learner's experts are moe/grouped.py's (model.experts auto on CPU): ModelOpt's quant module around our
    # GroupedLinear, registered by qat/modules.py; attention's are ModelOpt's around Megatron's linears
    assert "QuantGroupedLinear" in r["types"]
    assert r["types"] <= {"QuantColumnParallelLinear", "QuantRowParallelLinear", "QuantGroupedLinear"}
    assert {"modelopt", "megatron_qarl"} <= r["mro"]
    assert r["weight_backends"] == {(weight_backend, True)}
    if scheme == "w4a16":  # weight-only: inputs stay BF16; attention is not quantized, and not even converted
        assert {b for b, _ in r["act_backends"]} <= {None, act_backend} and not any(on for _, on in r["act_backends"])
        assert r["types"] == {"QuantGroupedLinear"} and r["converted"] == {"linear_fc1", "linear_fc2"}, r["converted"]
    else:
        assert r["act_backends"] == {(act_backend, True)}
        assert "megatron" in r["mro"] and "output_layer" in r["disabled"]


def _resume(model_dir: str, tp: int, ep: int, ckpt: str) -> dict:
    """Two aligned W4A16 steps straight vs one step, dist-checkpoint save, a fresh learner loading it, one step."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.checkpoint import load_learner, save_learner
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=7)
    tokens = torch.randint(0, arch.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 15)
    batch = Batch(tokens, mask)

    def loss_fn(logp, b):
        return token_mean_nll(logp, b, int(mask.sum()))

    def learner():
        return Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=1e-3), quant=QuantConfig(scheme="w4a16"))

    straight = learner()
    straight.load_hf(model_dir)
    first = straight.train_step(batch, loss_fn)
    save_learner(ckpt, straight.module, straight.optimizer)
    codes_saved = {k: v.codes.clone() for k, v in handed_codes(straight.fake_quant).items()}
    second = straight.train_step(batch, loss_fn)

    resumed = learner()  # random init, then the checkpoint
    load_learner(ckpt, resumed.module, resumed.optimizer)
    resumed.fake_quant.invalidate()
    codes_loaded = {k: v.codes for k, v in handed_codes(resumed.fake_quant).items()}
    again = resumed.train_step(batch, loss_fn)
    return {"first": first["loss"], "second": second["loss"], "again": again["loss"],
            "codes_equal": codes_saved.keys() == codes_loaded.keys()
            and all(torch.equal(codes_saved[k], codes_loaded[k]) for k in codes_saved),
            "n_codes": len(codes_saved)}


@pytest.mark.multiproc
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2)])
def test_dist_checkpoint_resume_with_modelopt_quantizers(tp, ep, tiny_model_dir, tmp_path):
    results = run_ranks(world_size(tp, ep), _resume, tiny_model_dir, tp, ep, str(tmp_path / "ckpt"))
    for r in results:
        assert r["n_codes"] > 0 and r["codes_equal"], r
        assert r["again"] == r["second"] and r["second"] != r["first"], r
