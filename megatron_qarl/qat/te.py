"""Transformer Engine FP8 for the w8a8_fp8 scheme: Megatron TransformerConfig settings, TE imported lazily.

``te_fp8_settings(cfg)`` gives the TransformerConfig kwargs that run the learner's GEMMs in TE FP8 with
the block-wise recipe (Float8BlockScaling: 1 x 128 activation tiles, 128 x 128 weight blocks, the
DeepSeek-V3 layout SGLang's ``fp8`` block method serves). It is a speed path: TE quantizes with its own
kernels (power-of-two scales unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1, its own rounding), so its
operands are close to, not identical with, the exported codes. The rollout-aligned path of QaRL is the
fake-quant forward (``fake_quant.py``), whose operands are exactly the exported ones.
Field names checked against megatron-core 0.16.1 (``TransformerConfig.fp8``, ``fp8_recipe``, ...).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from megatron_qarl.qat.config import QuantConfig

TE_BLOCK = 128  # Float8BlockScaling's tile edge


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


def require_transformer_engine() -> ModuleType:
    """Import and return ``transformer_engine.pytorch``; ImportError with the reason when it cannot."""
    try:
        import transformer_engine.pytorch as te_pytorch  # noqa: PLC0415 - lazy: GPU clusters only
    except Exception as err:  # TE's meta package raises RuntimeError / ImportError when the wheel is empty
        raise ImportError(
            "w8a8_fp8 with Transformer Engine needs transformer-engine[pytorch]>=2.4 on a CUDA machine "
            f"(pip install 'megatron_qarl[gpu]'); importing it failed: {err}"
        ) from err
    return te_pytorch


def apply_te_fp8(transformer_config_kwargs: dict[str, Any], cfg: QuantConfig) -> dict[str, Any]:
    """``transformer_config_kwargs`` updated with ``te_fp8_settings(cfg)``; requires TE when FP8 is on."""
    settings = te_fp8_settings(cfg)
    if settings:
        require_transformer_engine()
    return {**transformer_config_kwargs, **settings}
