"""Megatron's Transformer Engine layer spec: the parameter table of ``moe/convert.py`` (``param_maps(impl="te")``)
against the model that Megatron-Core 0.16.1's own spec code declares, and ``model.impl``.

Without TE (this machine, CI), the spec comes from Megatron's ``get_gpt_layer_with_transformer_engine_spec`` (called
through ``moe.te.te_layer_spec``) and is built into a GPTModel whose TE classes are the stand-ins of
tests/te_standins.py: they register TE's parameter names and compute what TE computes, so every module path comes
from Megatron's spec and module code, every parameter name from TE's. Where TE is installed the same checks run on
the real TE model (``test_real_te_model_matches_the_table``)."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import te_standins
import torch

from megatron_qarl.errors import ConfigError, UserError
from megatron_qarl.learner.checkpoint import LEARNER_META, check_loadable
from megatron_qarl.moe import te as moe_te
from megatron_qarl.moe.convert import (
    Layout,
    SafetensorsDir,
    hf_to_shard,
    iter_hf_tensors,
    load_hf_into_model,
    model_impl,
    param_maps,
)
from megatron_qarl.moe.model import (
    Qwen3MoeArch,
    build_model,
    causal_mask,
    expert_tp,
    forward_logits,
    transformer_config,
)
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.preflight.rules import load_config

NEEDS_TE = pytest.mark.skipif(not moe_te.transformer_engine_available(),
                              reason="Transformer Engine is not installed (the stand-in tests cover the names)")


def _te_model_from_megatrons_spec(arch: Qwen3MoeArch, tp: int = 1, ep: int = 1):
    """Megatron's TE layer spec (our te_layer_spec: Megatron's function with our arguments) built into a GPTModel,
    with the TE stand-ins bound. The config is the learner's (TE's fused kernels need TE; they do not name any
    parameter) with grouped-GEMM experts, which the TE spec asks for."""
    from megatron.core.models.gpt import GPTModel

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        te_standins.install(mp)
        mp.setattr(moe_te, "require_transformer_engine", lambda: None)
        spec = moe_te.te_layer_spec(arch)
        config = dataclasses.replace(transformer_config(arch, tp=tp, ep=ep, sp=tp > 1), moe_grouped_gemm=True)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab_size,
                        max_sequence_length=arch.max_position_embeddings, pre_process=True, post_process=True,
                        share_embeddings_and_output_weights=False, position_embedding_type="rope",
                        rotary_base=int(arch.rope_theta), rotary_percent=1.0)


def _declared_vs_table(model, arch: Qwen3MoeArch, impl: str, lay: Layout, hf) -> tuple[dict, dict]:
    """({name: shape} the model has, {name: shape} param_maps(impl) states for this rank)."""
    declared = {n: tuple(p.shape) for n, p in model.named_parameters()}
    table = {pm.mcore: tuple(hf_to_shard(pm, hf.__getitem__, arch, lay).shape)
             for pm in param_maps(arch, lay.ep_rank, lay.ep, impl)}
    return declared, table


@pytest.fixture()
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron_qarl.moe.parallelize import destroy_parallel, free_port

    os.environ["MASTER_PORT"] = str(free_port())
    init_parallel(tp=1, ep=1)
    yield
    destroy_parallel()


@pytest.mark.parametrize("impl", ["local", "te"])
def test_every_parameter_megatron_declares_is_in_the_table(impl, random_model_dir, one_rank):
    """Names and shapes: the table and the model agree both ways (a renamed or missing parameter fails here)."""
    arch = Qwen3MoeArch.from_model_dir(random_model_dir)
    model = build_model(arch) if impl == "local" else _te_model_from_megatrons_spec(arch)
    declared, table = _declared_vs_table(model, arch, impl, Layout(), SafetensorsDir(random_model_dir))
    assert declared == table
    assert model_impl(model) == impl


def test_te_spec_names_differ_from_local_where_te_fuses(random_model_dir, one_rank):
    """What the TE spec changes, read off the two models: the attention norm folds into linear_qkv, the experts
    become one grouped linear per projection; the MoE layer's pre-MLP norm stays a module of its own."""
    arch = Qwen3MoeArch.from_model_dir(random_model_dir)
    local = {n for n, _ in build_model(arch).named_parameters() if n.startswith("decoder.layers.0.")}
    te = {n for n, _ in _te_model_from_megatrons_spec(arch).named_parameters() if n.startswith("decoder.layers.0.")}
    strip = len("decoder.layers.0.")
    assert sorted(n[strip:] for n in local - te) == sorted(
        ["input_layernorm.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc{i}.weight"
                                      for e in range(arch.num_experts) for i in (1, 2)])
    assert sorted(n[strip:] for n in te - local) == sorted(
        ["self_attention.linear_qkv.layer_norm_weight"] + [f"mlp.experts.linear_fc{i}.weight{e}"
                                                           for e in range(arch.num_experts) for i in (1, 2)])
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te


def test_te_spec_model_loaded_from_hf_computes_the_local_logits(tiny_model_dir, one_rank):
    """Values, not only names: the HF weights loaded through the TE table give the local model's logits, and the
    model exports back every HF tensor exactly (an expert or a gate/up half in the wrong slot fails here)."""
    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    hf = SafetensorsDir(tiny_model_dir)
    # the TE stand-ins' attention is Megatron's DotProductAttention (tests/te_standins.py): the same kernels locally
    te_model, local = _te_model_from_megatrons_spec(arch), build_model(arch, attention="unfused")
    load_hf_into_model(te_model, arch, hf)
    load_hf_into_model(local, arch, hf)
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (forward_logits(te_model.eval(), tokens) - forward_logits(local.eval(), tokens)).abs().max()
    assert float(diff) <= 1e-6
    exported = dict(iter_hf_tensors(te_model, arch))
    assert sorted(exported) == sorted(hf.keys())
    assert all(torch.equal(exported[k], hf[k]) for k in hf.keys())


def test_the_te_specs_core_attention_takes_the_fp8_kv_caches_keys_and_values(tiny_model_dir, one_rank):
    """rollout.kv_cache_dtype on the TE spec: qat/kv_cache.py's hook sits on whatever module is the core attention
    (TE's DotProductAttention here, its stand-in), so the TE model with the hook computes the local model with the
    hook, and neither what they compute without it."""
    from megatron_qarl.qat.kv_cache import KVCacheSpec, KVFakeQuant

    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    hf = SafetensorsDir(tiny_model_dir)
    # the stand-ins attend as Megatron's DotProductAttention (tests/te_standins.py): the same kernels locally
    te_model, local = _te_model_from_megatrons_spec(arch), build_model(arch, attention="unfused")
    assert type(te_model.decoder.layers[0].self_attention.core_attention).__name__ == "TEDotProductAttentionStandIn"
    load_hf_into_model(te_model, arch, hf)
    load_hf_into_model(local, arch, hf)
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = forward_logits(local.eval(), tokens)
        spec = KVCacheSpec.build("fp8_e4m3", torch.bfloat16, arch.num_hidden_layers)
        hooks = [KVFakeQuant(te_model, spec), KVFakeQuant(local, spec)]
        te_kv, local_kv = forward_logits(te_model.eval(), tokens), forward_logits(local.eval(), tokens)
        for h in hooks:
            h.remove()
    assert float((te_kv - local_kv).abs().max()) <= 1e-6
    assert float((te_kv - plain).abs().max()) > 1e-2


def _te_rank(model_dir: str, tp: int, ep: int) -> dict:
    """One rank of a TP/EP layout: the TE table against Megatron's TE spec, and TE vs local logits."""
    import torch.distributed as dist

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep)
    hf = SafetensorsDir(model_dir)
    lay = Layout.current()
    te_model = _te_model_from_megatrons_spec(arch, tp, ep)
    declared, table = _declared_vs_table(te_model, arch, "te", lay, hf)
    local = build_model(arch, tp=tp, ep=ep, attention="unfused")  # the stand-ins attend as DotProductAttention
    load_hf_into_model(te_model, arch, hf)
    load_hf_into_model(local, arch, hf)
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (forward_logits(te_model.eval(), tokens) - forward_logits(local.eval(), tokens)).abs().max()
    exported = dict(iter_hf_tensors(te_model, arch))
    exact = sorted(exported) == sorted(hf.keys()) and all(torch.equal(exported[k], hf[k]) for k in hf.keys())
    return {"rank": dist.get_rank(), "etp": lay.etp, "same_names": declared == table,
            "missing": sorted(set(table) - set(declared))[:3], "extra": sorted(set(declared) - set(table))[:3],
            "max_logit_diff": float(diff), "round_trip_exact": exact}


@pytest.mark.multiproc
@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_te_table_holds_for_tensor_and_expert_parallel_ranks(tp, ep, random_model_dir):
    """Every rank's TE parameters (ETP-split grouped linears with TP = 2, half the experts per rank with EP = 2)."""
    for r in run_ranks(max(tp, ep), _te_rank, random_model_dir, tp, ep):
        assert r["same_names"], r
        assert r["etp"] == expert_tp(tp, ep)
        assert r["max_logit_diff"] <= 1e-5 and r["round_trip_exact"], r


def test_dist_checkpoint_keys_differ_only_for_the_pre_mlp_norm(random_model_dir, one_rank):
    """Megatron's sharded_state_dict_keys_map: the local spec stores its norms under the fused TE names, so a
    checkpoint's keys are the same for both specs except the MoE pre-MLP norm (which the TE MoE spec keeps as
    ``pre_mlp_layernorm``, while the local spec maps it to ``mlp.linear_fc1.layer_norm_weight``). Expert keys are
    left out: TE computes them in its own grouped-linear code, which the stand-ins do not reproduce."""
    arch = Qwen3MoeArch.from_model_dir(random_model_dir)

    def keys(model) -> dict[str, str]:
        return {k: v.key for k, v in model.sharded_state_dict().items()
                if "_extra_state" not in k and ".experts." not in k}

    local, te = keys(build_model(arch)), keys(_te_model_from_megatrons_spec(arch))
    te_name = {pm.hf: pm.mcore for pm in param_maps(arch, impl="te")}
    pairs = {pm.mcore: te_name[pm.hf] for pm in param_maps(arch, impl="local") if pm.mcore in local}
    assert len(pairs) == len(local) == len(te)
    differ = {name: (local[name], te[twin]) for name, twin in pairs.items() if local[name] != te[twin]}
    assert differ == {f"decoder.layers.{L}.pre_mlp_layernorm.weight":
                      ("decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight")
                      for L in range(arch.num_hidden_layers)}


def test_a_checkpoint_resumes_only_with_the_impl_that_wrote_it(tmp_path):
    check_loadable(tmp_path, "local", True)  # no record: written before the TE spec existed, i.e. local
    with pytest.raises(UserError, match=r"model.impl='local'.*this learner built model.impl='te'"):
        check_loadable(tmp_path, "te", True)
    (tmp_path / LEARNER_META).write_text(json.dumps({"model_impl": "te"}))
    check_loadable(tmp_path, "te", True)
    for impl in ("local", "grouped"):
        with pytest.raises(UserError, match="resume with model.impl=te"):
            check_loadable(tmp_path, impl, True)


def test_learner_checkpoints_record_their_impl(tiny_model_dir, tmp_path, one_rank):
    """save_learner writes the record; load_learner reads it back into the same spec and refuses another."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.checkpoint import load_learner, save_learner
    from megatron_qarl.learner.rank import Learner

    learner = Learner(Qwen3MoeArch.from_model_dir(tiny_model_dir), ParallelConfig(), OptimConfig())
    save_learner(tmp_path / "ckpt", learner.module, learner.optimizer)
    assert json.loads((tmp_path / "ckpt" / LEARNER_META).read_text()) == {
        "model_impl": "local", "experts": "grouped", "optimizer_format": "dp_reshardable"}
    load_learner(tmp_path / "ckpt", learner.module, learner.optimizer)
    (tmp_path / "ckpt" / LEARNER_META).write_text(json.dumps({"model_impl": "te"}))
    with pytest.raises(UserError, match="written by a learner with model.impl='te'"):
        load_learner(tmp_path / "ckpt", learner.module, learner.optimizer)


# ------------------------------------------------------------------------------------------------ model.impl
def test_model_impl_is_a_validated_key(tmp_path, tiny_model_dir):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model:\n  path: {tiny_model_dir}\n")
    assert load_config(cfg_file).model.impl == "auto"
    assert load_config(cfg_file, ["model.impl=te"]).model.impl == "te"
    with pytest.raises(ConfigError, match=r"^model\.impl: .*'auto', 'local' or 'te'"):
        load_config(cfg_file, ["model.impl=transformer_engine"])


@pytest.mark.skipif(moe_te.transformer_engine_available(), reason="Transformer Engine is installed here")
def test_impl_resolves_to_local_without_te_and_te_says_what_is_missing():
    assert moe_te.resolve_impl("auto") == "local" and moe_te.resolve_impl("local") == "local"
    with pytest.raises(ConfigError, match=r"^model\.impl: 'te' .*transformer-engine\[core_cu13,pytorch\]"):
        moe_te.resolve_impl("te")


def test_auto_picks_te_where_it_imports(monkeypatch):
    monkeypatch.setattr(moe_te, "require_transformer_engine", lambda: None)
    assert moe_te.resolve_impl("auto") == "te" and moe_te.resolve_impl("te") == "te"
    assert moe_te.resolve_impl("local") == "local"


@pytest.mark.parametrize("capability, preset, expected", [((9, 0), None, "1"), ((10, 0), None, None),
                                                          ((9, 0), "0", "0")])
def test_fp32_block_scales_are_preferred_on_hopper_only(capability, preset, expected, monkeypatch):
    monkeypatch.delenv(moe_te.FP32_SCALES_ENV, raising=False)
    if preset is not None:
        monkeypatch.setenv(moe_te.FP32_SCALES_ENV, preset)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    moe_te.prefer_fp32_block_scales()
    assert os.environ.get(moe_te.FP32_SCALES_ENV) == expected


# ------------------------------------------------------------------------------------------- with real TE
@pytest.mark.gpu
@NEEDS_TE
def test_real_te_model_matches_the_table(tiny_model_dir, one_rank):
    """Where TE is installed (CUDA): Megatron's real TE model has exactly the table's names and shapes, and loads
    the HF weights to the local model's logits (bf16 GEMMs: within bf16 rounding)."""
    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    hf = SafetensorsDir(tiny_model_dir)
    te_model = build_model(arch, dtype=torch.bfloat16, te=True).cuda()
    declared, table = _declared_vs_table(te_model, arch, "te", Layout(), hf)
    assert declared == table
    local = build_model(arch, dtype=torch.bfloat16).cuda()
    load_hf_into_model(te_model, arch, hf)
    load_hf_into_model(local, arch, hf)
    seq = 128  # TE wants token counts in multiples of 16
    tokens = torch.randint(0, arch.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand_as(tokens)
    mask = causal_mask(seq).cuda()
    with torch.no_grad():
        a, b = (m.eval()(tokens, pos, mask).float() for m in (te_model, local))
    assert float((a - b).abs().max()) <= 0.05 * float(b.abs().max())
