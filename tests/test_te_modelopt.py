"""ModelOpt's real Transformer Engine plugin on the learner's TE model, and what the learner's GEMMs multiply.

The learner (``Learner(impl="te")``: Megatron's TE spec, ``moe/te.py``; ModelOpt fake quant, ``qat/modules.py``) runs in
a fresh process where ``import transformer_engine`` gives the stand-ins of tests/te_standins.py, imported before
ModelOpt, so that ModelOpt 0.47 loads its TE plugin (modelopt/torch/quantization/plugins/transformer_engine.py) and
its Megatron plugin's TE registrations, and converts the TE linears with them: their forwards run the plugin's own
code, ``_assert_te_fp8_enabled`` included, which reads TE's fp8 autocast state (the stand-in's
``FP8GlobalStateManager``, entered by Megatron's transformer block through ``get_fp8_context`` when
``TransformerConfig.fp8`` is set). Megatron's CUDA fusions (fused RoPE, masked softmax, permute: kernels TE or apex
provide on GPUs) stay off here; they change no operand of a GEMM.

Checked (docs/quantization.md, "FP8 on the TE spec"): w8a8_fp8 on the TE spec runs ModelOpt's quant modules without
fp8 autocast (main at 24d59b3 turned TE's blockwise FP8 recipe on for it, and its first forward raised ModelOpt's
RuntimeError); every weight its GEMMs multiply equals SGLang's dequantization (``block_quant_dequant``, run in
SGLang's process) of the codes and scales the weight sync sends; its log-probs are the local spec's; a train step
goes through the plugin's backward. ``model.te_fp8`` (bf16 only) runs every TE GEMM under fp8 autocast, and
``apply_fake_quant`` refuses such a model.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import sglang_stubs as stubs
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny-qwen3-moe"
SEQ = 24


def _child_env() -> None:
    from megatron_qarl.moe.parallelize import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _learner(arch, scheme: str, impl: str, dtype, **kwargs):
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.qat.config import QuantConfig

    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-4), dtype=dtype, quant=QuantConfig(scheme=scheme),
                      impl=impl, **kwargs)
    learner.load_hf(str(TINY))
    return learner


def te_learners_under_modelopts_te_plugin() -> dict:
    """In a fresh process: the w8a8_fp8 TE learner's forward (GEMM operands recorded), sync payload and train step;
    the local learner's forward; the bf16 TE learner with model.te_fp8. Returns plain data (tensors torch.save'd)."""
    import te_standins

    # Megatron first, without TE, then TE's stand-in package, then ModelOpt's quantization plugins
    mp = te_standins.install_in_fresh_process()
    from megatron_qarl.learner.rank import Batch, token_mean_nll
    from megatron_qarl.moe.convert import param_maps, shards_to_hf
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.sync.payload import iter_sync_tensors

    _child_env()
    init_parallel()
    arch = Qwen3MoeArch.from_model_dir(TINY)
    tokens = torch.randint(0, arch.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    out: dict = {}

    te = _learner(arch, "w8a8_fp8", "te", torch.bfloat16)
    out["plugin_classes"] = sorted({type(m).__mro__[1].__module__ + "." + type(m).__mro__[1].__name__
                                    for m in te.module.modules() if isinstance(m, te_standins.GroupedLinear |
                                                                               te_standins.Linear |
                                                                               te_standins.LayerNormLinear)})
    with te_standins.recording() as log:
        logp_te = te.forward_logprobs(tokens)
    names = {id(m): n for n, m in te.module.named_modules()}
    per_module: dict[str, list] = {}
    for entry in log:
        per_module.setdefault(names[id(entry["module"])], []).append(entry)
    out["fp8_during_gemms"] = sorted({e["fp8"] for e in log})
    # the weight each quantized linear's GEMM multiplied, as Hugging Face tensors
    gemm_hf = {}
    targets = {t.pm.mcore for t in te.fake_quant.targets}
    for pm in param_maps(arch, impl="te"):
        if pm.mcore not in targets:
            continue
        module, param = pm.mcore.rsplit(".", 1)
        index = int(param.removeprefix("weight") or 0)
        gemm_hf.update(shards_to_hf(pm, [per_module[module][index]["weight"]], arch))
    payload = dict(iter_sync_tensors(te))
    buf = io.BytesIO()
    torch.save({"gemm": gemm_hf, "payload": payload}, buf)
    out["tensors"] = buf.getvalue()
    out["group_size"] = te.fake_quant.cfg.group_size
    mask = torch.ones(2, SEQ - 1)
    metrics = te.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
    out["train_step"] = {k: float(metrics[k]) for k in ("loss", "grad_norm", "skipped")}
    del te

    # the TE stand-ins attend as Megatron's DotProductAttention (te_standins.py): the local spec's unfused one alike
    local = _learner(arch, "w8a8_fp8", "local", torch.bfloat16, attention="unfused")
    logp_local = local.forward_logprobs(tokens)
    out["logp_max_diff"] = float((logp_te - logp_local).abs().max())
    out["logp_mean"] = float(logp_local.mean())
    del local

    out["te_fp8"] = _te_fp8_bf16(arch, tokens)
    out["te_fp8_w4a16"] = _te_fp8_w4a16(arch, tokens)
    mp.undo()
    return out


def _te_fp8_bf16(arch, tokens) -> dict:
    """model.te_fp8 with quant.scheme bf16: Megatron config and fp8 autocast around every TE GEMM."""
    import te_standins

    try:
        learner = _learner(arch, "bf16", "te", torch.bfloat16, te_fp8=True)
    except TypeError as err:  # main at 24d59b3: no model.te_fp8
        return {"error": f"{type(err).__name__}: {err}"}
    cfg = learner.module.config
    with te_standins.recording() as log:
        learner.forward_logprobs(tokens)
    return {"fp8": cfg.fp8, "fp8_recipe": str(cfg.fp8_recipe), "padding": cfg.moe_router_padding_for_fp8,
            "gemms": len(log), "fp8_during_gemms": sorted({e["fp8"] for e in log})}


def _gemms_by_module(learner, log) -> dict[str, list]:
    names = {id(m): n for n, m in learner.module.named_modules()}
    out: dict[str, list] = {}
    for entry in log:
        out.setdefault(names[id(entry["module"])], []).append(entry)
    return out


def _te_fp8_w4a16(arch, tokens) -> dict:
    """model.te_fp8 with quant.scheme w4a16 (issue 29): ModelOpt converts the experts' grouped linears only, whose
    GEMMs run with fp8 autocast off inside, on the fake-quant weights; attention's under fp8 autocast."""
    import te_standins

    from megatron_qarl.learner.rank import Batch, token_mean_nll

    try:
        learner = _learner(arch, "w4a16", "te", torch.bfloat16, te_fp8=True)
    except Exception as err:  # noqa: BLE001 - main before issue 29 refused it (moe.te.check_te_fp8)
        return {"error": f"{type(err).__name__}: {err}"}
    converted = sorted({type(m).__mro__[1].__name__ for m in learner.module.modules()
                        if hasattr(m, "weight_quantizer")})
    with te_standins.recording() as log:
        logp = learner.forward_logprobs(tokens)
    gemms = _gemms_by_module(learner, log)
    fp8 = {kind: sorted({e["fp8"] for n, es in gemms.items() for e in es if (".experts." in n) == (kind == "experts")})
           for kind in ("experts", "attention and the rest")}
    fake_quant_weights = all(
        torch.equal(gemms[t.pm.mcore.rsplit(".", 1)[0]][int(t.pm.mcore.rsplit(".", 1)[1].removeprefix("weight") or 0)]
                    ["weight"], t.local_fq) for t in learner.fake_quant.targets)
    mask = torch.ones(2, SEQ - 1)
    metrics = learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
    targets = len(learner.fake_quant.targets)
    del learner
    reference = _learner(arch, "w4a16", "te", torch.bfloat16)  # the same learner without model.te_fp8
    logp_ref = reference.forward_logprobs(tokens)
    return {"converted": converted, "fp8": fp8, "targets": targets, "fake_quant_weights": fake_quant_weights,
            "logp_max_diff": float((logp - logp_ref).abs().max()),
            "train_step": {k: float(metrics[k]) for k in ("loss", "grad_norm", "skipped")}}


def sg_block_dequant(tensors: bytes, block: int) -> dict[str, bytes]:
    """SGLang's own dequantization of the synced FP8 codes: block_quant_dequant(weight, weight_scale_inv,
    [block, block], bf16) (sglang/srt/layers/quantization/fp8_utils.py), per synced linear."""
    fp8_utils = stubs.module("sglang.srt.layers.quantization.fp8_utils")
    payload = torch.load(io.BytesIO(tensors), weights_only=True)["payload"]
    out = {}
    for name, codes in payload.items():
        if codes.dtype == torch.float8_e4m3fn:
            scale = payload[name.removesuffix("weight") + "weight_scale_inv"]
            out[name] = fp8_utils.block_quant_dequant(codes, scale, [block, block], torch.bfloat16)
    buf = io.BytesIO()
    torch.save(out, buf)
    return {"dequant": buf.getvalue()}


@pytest.fixture(scope="module")
def te_run():
    from bounded_child import run_in_child

    return run_in_child(te_learners_under_modelopts_te_plugin, timeout_s=840, name="TE learners under ModelOpt")


def test_modelopts_te_plugin_converts_the_te_linears_and_w8a8_fp8_runs_without_fp8_autocast(te_run):
    """Fails on main at 24d59b3: ModelOpt's ``_assert_te_fp8_enabled`` raised in the first forward."""
    assert te_run["plugin_classes"] == [
        "modelopt.torch.quantization.plugins.megatron._MegatronTEGroupedColumnParallelLinear",
        "modelopt.torch.quantization.plugins.megatron._MegatronTEGroupedRowParallelLinear",
        "modelopt.torch.quantization.plugins.megatron._QuantTELayerNormColumnParallelLinear",
        "modelopt.torch.quantization.plugins.megatron._QuantTEMCoreRowParallelLinear"]
    assert te_run["fp8_during_gemms"] == [False]
    assert te_run["logp_max_diff"] <= 0.05, te_run  # bf16 logits of two specs (norm fold, grouped experts)
    step = te_run["train_step"]
    assert step["skipped"] == 0.0 and step["grad_norm"] > 0 and torch.isfinite(torch.tensor(step["loss"]))


def test_the_te_gemms_multiply_the_codes_times_scales_sglang_receives(te_run):
    """Every quantized weight the TE learner's GEMMs multiplied == SGLang's block_quant_dequant of the synced
    weight / weight_scale_inv, bit for bit."""
    proc = stubs.SGLangProcess()
    try:
        sg = torch.load(io.BytesIO(proc.run(sg_block_dequant, te_run["tensors"], te_run["group_size"])["dequant"]),
                        weights_only=True)
    finally:
        proc.close()
    gemm = torch.load(io.BytesIO(te_run["tensors"]), weights_only=True)["gemm"]
    assert sorted(gemm) == sorted(sg) and len(gemm) > 0
    differ = {n: int((gemm[n] != sg[n]).sum()) for n in gemm if not torch.equal(gemm[n].to(torch.bfloat16), sg[n])}
    assert differ == {}, f"{len(differ)} of {len(gemm)} weights differ: {dict(list(differ.items())[:4])}"


def test_te_fp8_runs_every_te_gemm_under_fp8_autocast(te_run):
    """model.te_fp8 (bf16 runs): Megatron's blockwise recipe, fp8 autocast around every TE GEMM (the stand-ins
    compute no FP8 numerics: what is checked is that TE would)."""
    r = te_run["te_fp8"]
    assert "error" not in r, r
    assert (r["fp8"], r["fp8_recipe"], r["padding"]) == ("e4m3", "blockwise", True)
    assert r["gemms"] > 0 and r["fp8_during_gemms"] == [True]


def test_te_fp8_with_w4a16_runs_the_experts_outside_fp8_on_their_fake_quant_weights_and_attention_in_fp8(te_run):
    """The product card's learner (issue 29 item 9; refused at load before): ModelOpt's real TE plugin converts the
    experts' TE grouped linears only (attention's TE linears and TE's core attention stay TE modules), the experts'
    GEMMs multiply the fake-quant weights (the codes x scales the sync sends) with fp8 autocast off, every other TE
    GEMM runs under it, and a train step goes through the plugin's backward. The stand-ins compute no FP8: the
    log-probs equal those of the same learner without model.te_fp8 (on a GPU they differ by attention's FP8)."""
    r = te_run["te_fp8_w4a16"]
    assert "error" not in r, r
    assert r["converted"] == ["_MegatronTEGroupedColumnParallelLinear", "_MegatronTEGroupedRowParallelLinear"]
    assert r["fp8"] == {"experts": [False], "attention and the rest": [True]}
    assert r["targets"] > 0 and r["fake_quant_weights"]
    assert r["logp_max_diff"] <= 0.05, r
    step = r["train_step"]
    assert step["skipped"] == 0.0 and step["grad_norm"] > 0 and torch.isfinite(torch.tensor(step["loss"]))
