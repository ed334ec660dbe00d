"""Fake quantization for training: the forward uses the quantizer's dequantize(quantize(w)), the
backward is straight-through (the gradient at the fake-quant weight reaches the master weight unchanged).

``fake_quant_weight`` is the two-step form (quantize, then dequantize) of what the learner's weight quantizers
compute in one pass (``quantizer.fake_quantize_weight``, equal bit for bit: tests/test_qat_quantizer.py); the
learner hands the weight sync the ``QuantizedWeight`` of that very pass (qat/modules.py), so nothing is quantized
twice.

Learner forward of a quantized linear, in the module's dtype (bf16 in training): ModelOpt's quant module of the
linear (qat/modules.py) with its weight quantizer returning w_fq and its input quantizer x_fq:
    w4a16:      y = x @ w_fq^T                          w_fq = bf16((q - z) * s_b): Marlin's operand, exact
    w8a8_fp8:   y = x_fq @ w_fq^T                       x_fq = (q_x * s_x) per token group of 128,
    w8a8_int8:  y = x_fq @ w_fq^T                       w_fq = q_w * s_w, both cast to the module dtype
The W8A8 GPU kernels take the same codes and scales but multiply the scales in after an fp32 (FP8) or
exact int32 (INT8) accumulation; the learner rounds q * s to the module dtype first and accumulates in
its own order. The operands match exactly; the accumulation does not (docs/quantization.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.quantizer import (
    QuantizedWeight,
    fake_quant_act_fp8_per_token_group,
    fake_quant_act_int8_per_token,
    quantize_weight,
)


class _StraightThrough(torch.autograd.Function):
    """Forward returns ``quantized``; backward hands the incoming gradient to ``master`` as is."""

    @staticmethod
    def forward(ctx, master: Tensor, quantized: Tensor) -> Tensor:  # noqa: ARG004 - master only routes grad
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def straight_through(master: Tensor, quantized: Tensor) -> Tensor:
    """``quantized`` in the forward, identity gradient to ``master`` in the backward (same shape, dtype)."""
    if master.shape != quantized.shape or master.dtype != quantized.dtype:
        raise ValueError(
            f"straight_through: master {master.dtype}{list(master.shape)} vs "
            f"quantized {quantized.dtype}{list(quantized.shape)}"
        )
    return _StraightThrough.apply(master, quantized)


def fake_quant_weight(w: Tensor, cfg: QuantConfig, name: str = "weight") -> tuple[Tensor, QuantizedWeight]:
    """(w_fq, qw): w_fq = qw.dequantize() in ``w.dtype`` with a straight-through gradient to ``w``.

    ``qw`` holds the codes and scales of this very call; export them (``export.export_state_dict``).
    """
    with torch.no_grad():
        qw = quantize_weight(w.detach(), cfg, name)
        w_fq = qw.dequantize(w.dtype)
    return straight_through(w, w_fq), qw


def fake_quant_act(x: Tensor, cfg: QuantConfig) -> Tensor:
    """The activation the W8A8 engine feeds its GEMM, dequantized in ``x.dtype`` (STE backward).

    w8a8_fp8: per token, per group of ``cfg.group_size``; w8a8_int8: per token; other schemes: ``x``.
    """
    if cfg.scheme not in ("w8a8_fp8", "w8a8_int8"):
        return x
    with torch.no_grad():  # the codes' values only, never their own tensors (quantizer.fake_quant_act_*)
        x_fq = (fake_quant_act_fp8_per_token_group(x, cfg.group_size) if cfg.scheme == "w8a8_fp8"
                else fake_quant_act_int8_per_token(x))
    return straight_through(x, x_fq)
