"""Transformer Engine (TE) for the learner's Megatron model on CUDA. TE is imported lazily, so this module
imports on CPU machines; ``moe.model.build_model(..., te=True)`` builds the model with it.

- ``resolve_impl``: the config key ``model.impl`` (auto | local | te) to the layer spec a learner builds: auto is
  "te" where transformer_engine imports (and ``model.attention`` is auto), else "local"; "te" where it does not is a
  ConfigError naming the key.

- ``te_layer_spec``: Megatron's TE layer spec for Qwen3-MoE (fused TE linears with the RMSNorm folded into
  linear_qkv / linear_fc1, qk-norm, TE grouped-GEMM experts).
- ``te_transformer_config``: ``moe.model.transformer_config`` with ``te_config_overrides``: the CUDA fusions back
  on and, only with ``model.te_fp8``, TE's blockwise FP8 recipe (``te_fp8_settings``).

FP8 and fake quantization (docs/quantization.md, "FP8 on the TE spec"): the quantized GEMMs, w8a8_fp8's included,
run in BF16 on ModelOpt fake-quant operands (``qat/modules.py``: the exported codes x scales, the fake-quantized
activations), never under TE's fp8 autocast: ModelOpt 0.47's TE plugin refuses fp8 autocast in every forward of a
module it converted, and TE's own FP8 quantization (power-of-two scales by default, its own rounding) is not
SGLang's. ``te_fp8_settings`` (Megatron fp8="e4m3", fp8_recipe="blockwise") serves ``model.te_fp8`` for bf16 runs
and for w4a16 ones, where ModelOpt converts the experts' grouped linears only and they run with fp8 autocast off
inside (attention and the other GEMMs in FP8); ``check_te_fp8`` refuses every other use.
Field names checked against megatron-core 0.16.1 (``TransformerConfig.fp8``, ``fp8_recipe``, ...).
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Any

from megatron_qarl.errors import ConfigError

# TransformerConfig fields that moe/model.py turns off for CPU-only torch and that CUDA runs want on
# what the ``gpu`` extra installs (setup.py): megatron-core 0.16.1's tested range (its METADATA); qarl preflight
# checks the installed TE against the range the installed megatron-core declares
TE_REQUIREMENT = "transformer-engine[core_cu13,pytorch]>=2.9,<2.12"

CUDA_FUSIONS = {"apply_rope_fusion": True, "masked_softmax_fusion": True, "bias_activation_fusion": True,
                "bias_dropout_fusion": True, "gradient_accumulation_fusion": False, "moe_permute_fusion": True,
                "moe_grouped_gemm": True}


def te_fp8_settings() -> dict[str, Any]:
    """Megatron TransformerConfig kwargs of TE's blockwise FP8 GEMMs (``model.te_fp8``): fp8 "e4m3" (forward and
    backward tensors in e4m3), fp8_recipe "blockwise" (Float8BlockScaling: 1 x 128 activation tiles, 128 x 128
    weight blocks), weights kept in BF16 master params (fp8_param False), wgrad in FP8, no BF16 first/last
    layers. Megatron then runs every TE linear under TE's fp8 autocast."""
    return {
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "fp8_param": False,
        "fp8_wgrad": True,
        "first_last_layers_bf16": False,
    }


TE_FP8_SCHEMES = ("bf16", "w4a16")  # the quant.scheme values model.te_fp8 runs with


def check_te_fp8(te_fp8: bool, impl: str, scheme: str) -> None:
    """``model.te_fp8`` against ``model.impl`` and ``quant.scheme``: ConfigError naming the keys unless it is off,
    or on with model.impl 'te' and quant.scheme 'bf16' or 'w4a16'.

    With w4a16 ModelOpt converts only the experts' TE grouped linears (``qat/modules.py``), which run with TE's fp8
    autocast off inside (ModelOpt 0.47's TE plugin raises in the forward of every module it converted while fp8
    autocast is on, modelopt/torch/quantization/plugins/transformer_engine.py ``_assert_te_fp8_enabled``), on the
    fake-quant weights; attention's and the other TE GEMMs run in FP8. The W8A8 schemes quantize every TE linear
    (attention and experts), so nothing would be left to run in FP8."""
    if not te_fp8:
        return
    if scheme not in TE_FP8_SCHEMES:
        raise ConfigError(f"model.te_fp8: quant.scheme={scheme!r} quantizes every Transformer Engine linear "
                          "(attention and experts), whose fake-quant GEMMs run outside TE's fp8 autocast (ModelOpt's "
                          "TE plugin refuses it in each), so no GEMM would be left to run in FP8; TE's FP8 GEMMs serve "
                          "quant.scheme bf16 and w4a16 (attention in FP8, the W4A16 experts on their fake-quant "
                          "weights, docs/quantization.md). Set model.te_fp8=false")
    if impl != "te":
        raise ConfigError(f"model.te_fp8: TE's FP8 GEMMs need the Transformer Engine spec, model.impl='te' "
                          f"(got model.impl={impl!r})")


def transformer_engine_available() -> bool:
    """True when Transformer Engine's PyTorch package imports (never on the CPU-only machines)."""
    try:
        require_transformer_engine()
    except ImportError:
        return False
    return True


# TE's Float8BlockScaling reads this once, when transformer_engine is first imported: "1" gives fp32 block scales
# (amax / 448, SGLang's on Hopper) instead of the default power-of-two ones. Hopper only: on Blackwell TE emulates
# the recipe with MXFP8 and supports power-of-two scales alone (TE docs, "FP8 Blockwise Scaling").
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"


def prefer_fp32_block_scales() -> None:
    """Before TE is imported: on a Hopper GPU (compute capability 9.x) set NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1
    unless the environment already sets it, so that TE's FP8 block scales are fp32 like SGLang's on Hopper (slime
    sets the same default for its trainer actors). Elsewhere, or when set, the environment is left alone."""
    import torch

    if FP32_SCALES_ENV in os.environ or not torch.cuda.is_available():
        return
    if torch.cuda.get_device_capability()[0] == 9:
        os.environ[FP32_SCALES_ENV] = "1"


def te_fp8_block_scales() -> str:
    """The scale format TE's Float8BlockScaling recipe uses in this process: "fp32" or "power-of-two" (its
    default, fixed when transformer_engine was first imported). ImportError where TE is absent."""
    require_transformer_engine()
    from transformer_engine.common.recipe import Float8BlockScaling

    return "power-of-two" if Float8BlockScaling().fp8_quant_fwd_weight.power_2_scale else "fp32"


def resolve_impl(impl: str, attention: str = "auto", experts: str = "auto") -> str:
    """``model.impl`` -> the layer spec to build: "te" or "local". auto: "te" where Transformer Engine imports,
    else "local", and "local" when ``model.attention`` (``attention``) names a local-spec core attention (sdpa,
    unfused; ``moe.attention``) or ``model.experts`` (``experts``) local-spec experts (sequential, grouped;
    ``moe.grouped``). "te" where TE does not import: ConfigError naming the key and the package."""
    if impl == "local":
        return "local"
    if impl == "auto":
        local = attention != "auto" or experts != "auto"
        return "te" if not local and transformer_engine_available() else "local"
    if impl != "te":
        raise ConfigError(f"model.impl: {impl!r} is not one of 'auto', 'local', 'te'")
    try:
        require_transformer_engine()
    except ImportError as err:
        raise ConfigError(f"model.impl: 'te' builds Megatron's Transformer Engine layers, but transformer_engine "
                          f"({TE_REQUIREMENT}) does not import on this machine ({err}); use 'local' or "
                          f"'auto'") from None
    return "te"


def require_transformer_engine() -> ModuleType:
    """Import and return ``transformer_engine.pytorch``; ImportError with the reason when it cannot."""
    prefer_fp32_block_scales()
    try:
        import transformer_engine.pytorch as te_pytorch  # noqa: PLC0415 - lazy: GPU clusters only
    except Exception as err:  # TE's meta package raises RuntimeError / ImportError when the wheel is empty
        raise ImportError(
            f"the Transformer Engine model needs {TE_REQUIREMENT} (megatron-core's tested range) on a CUDA machine "
            f"(pip install 'megatron_qarl[gpu]'); importing it failed: {err}"
        ) from err
    return te_pytorch


def te_layer_spec_kwargs(arch) -> dict[str, Any]:
    """The arguments of Megatron's ``get_gpt_layer_with_transformer_engine_spec`` for Qwen3-MoE: every layer an MoE
    layer, qk-norm, the experts as TE grouped GEMMs (TEGroupedMLP; ``moe_convert.param_maps(impl="te")`` names its
    ``weight<e>`` parameters)."""
    return {"num_experts": arch.num_experts, "moe_grouped_gemm": True, "qk_layernorm": True}


def te_layer_spec(arch):
    """Megatron's Transformer Engine layer spec for Qwen3-MoE (RMSNorm via the config, qk-norm, MoE experts
    as TE grouped GEMMs). ImportError naming the package when TE is absent (CPU machines)."""
    require_transformer_engine()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(**te_layer_spec_kwargs(arch))


def te_config_overrides(fp8: bool = False) -> dict[str, Any]:
    """The TransformerConfig fields the TE path changes: the CUDA fusions and, with ``fp8`` (``model.te_fp8``),
    TE's blockwise FP8 recipe (FP8 grouped GEMMs need each expert's token count padded to a multiple of 16: the
    router pads). Pure: checked against Megatron's fields without TE."""
    fp8_settings = te_fp8_settings() if fp8 else {}
    return {**CUDA_FUSIONS, **fp8_settings, **({"moe_router_padding_for_fp8": True} if fp8 else {})}


def te_transformer_config(config, fp8: bool = False):
    """``config`` (``moe.model.transformer_config``'s, which that module owns) with ``te_config_overrides(fp8)``,
    for the TE spec on CUDA. ImportError naming the package when TE is absent."""
    overrides = te_config_overrides(fp8)
    require_transformer_engine()
    return dataclasses.replace(config, **overrides)
