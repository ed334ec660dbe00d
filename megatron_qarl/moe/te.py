"""Transformer Engine (TE) for the learner's Megatron model on CUDA. TE is imported lazily, so this module
imports on CPU machines; ``moe.model.build_model(..., te=quant)`` builds the model with it.

- ``resolve_impl``: the config key ``model.impl`` (auto | local | te) to the layer spec a learner builds: auto is
  "te" where transformer_engine imports, else "local"; "te" where it does not is a ConfigError naming the key.

- ``te_layer_spec``: Megatron's TE layer spec for Qwen3-MoE (fused TE linears with the RMSNorm folded into
  linear_qkv / linear_fc1, qk-norm, TE grouped-GEMM experts).
- ``te_transformer_config``: ``moe.model.transformer_config`` with ``te_config_overrides``: the CUDA fusions back
  on and, for w8a8_fp8, TE's blockwise FP8 recipe (``te_fp8_settings``).
- ``te_fp8_settings``: the TransformerConfig kwargs that run the learner's GEMMs in TE FP8 with the block-wise
  recipe (Float8BlockScaling: 1 x 128 activation tiles, 128 x 128 weight blocks, the DeepSeek-V3 layout SGLang's
  ``fp8`` block method serves). It is a speed path: TE quantizes with its own kernels (power-of-two scales unless
  NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1, its own rounding), so its operands are close to, not identical with, the
  exported codes. The rollout-aligned path of QaRL is the fake-quant forward (``qat/fake_quant.py``), whose
  operands are exactly the exported ones.
Field names checked against megatron-core 0.16.1 (``TransformerConfig.fp8``, ``fp8_recipe``, ...).
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Any

from megatron_qarl.errors import ConfigError
from megatron_qarl.qat.config import QuantConfig

TE_BLOCK = 128  # Float8BlockScaling's tile edge

# TransformerConfig fields that moe/model.py turns off for CPU-only torch and that CUDA runs want on
CUDA_FUSIONS = {"apply_rope_fusion": True, "masked_softmax_fusion": True, "bias_activation_fusion": True,
                "bias_dropout_fusion": True, "gradient_accumulation_fusion": False, "moe_permute_fusion": True,
                "moe_grouped_gemm": True}


def te_fp8_settings(cfg: QuantConfig) -> dict[str, Any]:
    """Megatron TransformerConfig kwargs for ``cfg`` (empty for schemes TE FP8 does not serve).

    w8a8_fp8 -> fp8 "e4m3" (forward and backward tensors in e4m3, as SGLang serves e4m3), fp8_recipe
    "blockwise", weights kept in BF16 master params (fp8_param False), wgrad in FP8, no BF16 first/last
    layers. Group sizes other than 128 have no TE recipe: ValueError.
    """
    if cfg.scheme != "w8a8_fp8":
        return {}
    if cfg.group_size != TE_BLOCK:
        raise ValueError(f"group_size: TE blockwise FP8 uses {TE_BLOCK}-wide blocks, got {cfg.group_size}")
    return {
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "fp8_param": False,
        "fp8_wgrad": True,
        "first_last_layers_bf16": False,
    }


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


def resolve_impl(impl: str) -> str:
    """``model.impl`` -> the layer spec to build: "te" or "local". auto: "te" where Transformer Engine imports,
    else "local". "te" where TE does not import: ConfigError naming the key and the package."""
    if impl == "local":
        return "local"
    if impl == "auto":
        return "te" if transformer_engine_available() else "local"
    if impl != "te":
        raise ConfigError(f"model.impl: {impl!r} is not one of 'auto', 'local', 'te'")
    try:
        require_transformer_engine()
    except ImportError as err:
        raise ConfigError(f"model.impl: 'te' builds Megatron's Transformer Engine layers, but transformer_engine "
                          f"(transformer-engine[pytorch]) does not import on this machine ({err}); use 'local' or "
                          f"'auto'") from None
    return "te"


def require_transformer_engine() -> ModuleType:
    """Import and return ``transformer_engine.pytorch``; ImportError with the reason when it cannot."""
    prefer_fp32_block_scales()
    try:
        import transformer_engine.pytorch as te_pytorch  # noqa: PLC0415 - lazy: GPU clusters only
    except Exception as err:  # TE's meta package raises RuntimeError / ImportError when the wheel is empty
        raise ImportError(
            "the Transformer Engine model needs transformer-engine[pytorch]>=2.4 on a CUDA machine "
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


def te_config_overrides(quant: QuantConfig) -> dict[str, Any]:
    """The TransformerConfig fields the TE path changes: the CUDA fusions and, for w8a8_fp8, TE's blockwise FP8
    recipe (FP8 grouped GEMMs need each expert's token count padded to a multiple of 16: the router pads).
    Pure: checked against Megatron's fields without TE."""
    fp8 = te_fp8_settings(quant)
    return {**CUDA_FUSIONS, **fp8, **({"moe_router_padding_for_fp8": True} if fp8 else {})}


def te_transformer_config(config, quant: QuantConfig):
    """``config`` (``moe.model.transformer_config``'s, which that module owns) with ``te_config_overrides(quant)``,
    for the TE spec on CUDA. ImportError naming the package when TE is absent."""
    overrides = te_config_overrides(quant)
    require_transformer_engine()
    return dataclasses.replace(config, **overrides)
