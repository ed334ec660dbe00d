"""The pieces of a Qwen3-MoE layer that the learner (moe/exact.py) computes with and the engine's blocks (exact.c
``qx_attn_block`` / ``qx_moe_block``, serve/exact_forward.py) compute in C, in the same order with the same
rounding points (tests/test_numerics_exact.py compares the two).
``act`` is the servers' activation dtype: every activation is rounded to it where the engine stores one."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_qarl.numerics import ops


def norm(x: Tensor, w: Tensor, eps: float, act: torch.dtype) -> Tensor:
    """round(RMSNorm(x) * w)."""
    return ops.round_to(ops.rms_norm(x, w, eps), act)


def qk_norm_rope(q_THD: Tensor, k_TGD: Tensor, q_norm: Tensor, k_norm: Tensor, cos_TD: Tensor, sin_TD: Tensor,
                 eps: float, act: torch.dtype) -> tuple[Tensor, Tensor]:
    """Qwen3's per-head q/k RMSNorm, rounded, then RoPE, rounded."""
    q = ops.round_to(ops.rope(norm(q_THD, q_norm, eps, act), cos_TD, sin_TD), act)
    k = ops.round_to(ops.rope(norm(k_TGD, k_norm, eps, act), cos_TD, sin_TD), act)
    return q, k


def dense(x: Tensor, w: Tensor, act: torch.dtype) -> Tensor:
    """round(x @ w.T)."""
    return ops.round_to(ops.linear(x, w), act)


def moe_route(n_TH: Tensor, w_router: Tensor, top_k: int, norm_topk: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The router: float32 logits (not rounded) -> ``ops.route`` (ids ascending, weights, ids in top-k order)."""
    return ops.route(ops.linear(n_TH, w_router), top_k, norm_topk)


def logprobs_of(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """log_softmax(z / T)[label] over the full vocabulary, float32."""
    return ops.log_softmax(ops.scale_logits(logits, temperature)).gather(-1, labels[..., None])[..., 0]
