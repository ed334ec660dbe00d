"""The exact operations both the rollout engine and the learner compute a token with (``numerics: exact``).

Each forward runs a kernel of ``exact.c`` (``native.py``) whose result for a row depends on that row's operands
only; each has a torch reference of the same formula, which the tests compare the kernels against. Gradients are
those of the formula, not bit-exact: the linear's are two matmuls, RMSNorm's and SiLU x up's come from one-pass
kernels (``qx_rmsnorm_bwd``, ``qx_silu_mul_bwd``), the others from autograd of the reference (``_Exact``).
Activations are float32 tensors; ``round_to(x, act)`` is the one rounding point to the servers' activation dtype
(``act`` bfloat16 or float32), applied at the same places on both sides (``layers.py``); its gradient passes
straight through.

    linear(x, w)        y = x @ w.T, K reduced in chunks of CHUNK (32) added in chunk order, each chunk one
                        float32 sum in ascending k (exact.c ``qx_linear``); ``linear_partials`` returns the chunks, and
                        ``sum_chunks`` adds them in order (tensor-parallel row-parallel sums)
    rms_norm(x, w)      (x * 1/sqrt(mean(x^2) + eps)) * w
    silu_mul(g, u)      g / (1 + exp(-g)) * u
    softmax / log_softmax over the last dim, float32, max-shifted, the sum in index order
    attention           a query over exactly its keys, in key order (``attention_causal``: position s sees 0..s)
    rope                x * cos + roll(x, D/2) * sin_signed with float32 tables of ``rope_tables``
    route               softmax over all experts, top-k by a stable sort (ties: the lower expert id), optionally
                        renormalised (w_k / (w_1 + ... + w_k), summed in top-k order), then ordered by expert id
    combine             sum_k w_k * y_k in ascending expert order, float32
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_qarl.numerics import native
from megatron_qarl.qat.fake_quant import straight_through
from megatron_qarl.qat.quantizer import (
    dequant_act_fp8_per_token_group,
    dequant_act_int8_per_token,
    quant_act_fp8_per_token_group,
    quant_act_int8_per_token,
)

CHUNK = 32  # K is reduced in chunks of this many elements (when K is a multiple of it; else one chunk of K)


def chunk_of(k: int) -> int:
    """The reduction chunk of a K-long dot product: CHUNK when it divides K, else K (a single chunk)."""
    return CHUNK if k % CHUNK == 0 else k


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Exact(torch.autograd.Function):
    """Forward: ``fast(*inputs)`` (a kernel); backward: autograd of ``ref(*inputs)``, recomputed."""

    @staticmethod
    def forward(ctx, fast: Callable, ref: Callable, *inputs: Tensor) -> Tensor:
        ctx.ref = ref
        ctx.save_for_backward(*inputs)
        return fast(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.ref(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))


def exact(fast: Callable, ref: Callable, *inputs: Tensor) -> Tensor:
    """``fast(*inputs)`` with the gradient of ``ref(*inputs)`` when one is needed."""
    if _needs_grad(*inputs):
        return _Exact.apply(fast, ref, *inputs)
    return fast(*inputs)


class _Round(torch.autograd.Function):
    """Forward: the rounding; backward: the identity (straight through: the gradient is not itself rounded)."""

    @staticmethod
    def forward(ctx, x: Tensor, act: torch.dtype) -> Tensor:
        return _rounded(x, act)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _rounded(x: Tensor, act: torch.dtype) -> Tensor:
    if act == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu":
        return native.round_bf16(x)  # one pass (torch's x.to(bf16).float() makes two and a bf16 copy)
    return x.to(act).float()


def round_to(x: Tensor, act: torch.dtype) -> Tensor:
    """The rounding point: x rounded to ``act`` (round to nearest even) and held in float32 (identity for float32);
    its gradient passes straight through."""
    if act == torch.float32:
        return x
    return _Round.apply(x, act) if _needs_grad(x) else _rounded(x, act)


# --------------------------------------------------------------------------------------------- linear algebra
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: Tensor, w_NK: Tensor) -> Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        return native.linear(x_MK, w_NK, chunk_of(x_MK.shape[1]))

    @staticmethod
    def backward(ctx, g_MN: Tensor):
        x_MK, w_NK = ctx.saved_tensors
        return g_MN @ w_NK if ctx.needs_input_grad[0] else None, g_MN.t() @ x_MK if ctx.needs_input_grad[1] else None


def linear(x: Tensor, w_NK: Tensor) -> Tensor:
    """y = x @ w.T over the last dim of ``x`` (any leading shape), chunk sums in order (exact.c ``qx_linear``)."""
    x_MK = x.reshape(-1, x.shape[-1])
    y = _Linear.apply(x_MK, w_NK) if _needs_grad(x_MK, w_NK) else native.linear(x_MK, w_NK, chunk_of(x.shape[-1]))
    return y.view(*x.shape[:-1], w_NK.shape[0])


def _partials_ref(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    c = chunk_of(x_MK.shape[1])
    return torch.einsum("mck,nck->mnc", x_MK.view(x_MK.shape[0], -1, c), w_NK.view(w_NK.shape[0], -1, c))


def linear_partials(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """The chunk partial sums of ``linear``: [M, N, K / CHUNK] (a row-parallel rank's share of the full K)."""
    return exact(lambda a, b: native.linear(a, b, chunk_of(a.shape[1]), partials=True), _partials_ref,
                 x_MK.contiguous(), w_NK)


def sum_chunks(p_MNC: Tensor) -> Tensor:
    """s = p[..., 0]; s = s + p[..., c] for c = 1, 2, ...: the order ``qx_linear`` adds its chunks in."""
    s = p_MNC[..., 0]
    for c in range(1, p_MNC.shape[-1]):
        s = s + p_MNC[..., c]
    return s


# ------------------------------------------------------------------------------------------ pointwise and rows
class _RmsNorm(torch.autograd.Function):
    """Forward: exact.c ``qx_rmsnorm``; backward: the formula's gradient in one pass (``qx_rmsnorm_bwd``)."""

    @staticmethod
    def forward(ctx, x_MH: Tensor, w: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x_MH, w)
        ctx.eps = eps
        return native.rms_norm(x_MH, w, eps)

    @staticmethod
    def backward(ctx, g: Tensor):
        x_MH, w = ctx.saved_tensors
        gx, xhat = native.rms_norm_backward(x_MH, w, ctx.eps, g)
        return gx, (g * xhat).sum(0) if ctx.needs_input_grad[1] else None, None


class _SiluMul(torch.autograd.Function):
    """Forward: exact.c ``qx_silu_mul``; backward: the formula's gradient in one pass (``qx_silu_mul_bwd``)."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(g, u)
        return native.silu_mul(g, u)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return native.silu_mul_backward(*ctx.saved_tensors, grad)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """(x * 1/sqrt(mean(x^2) + eps)) * w over the last dim (exact.c ``qx_rmsnorm``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    y = _RmsNorm.apply(x2, w, eps) if _needs_grad(x2, w) else native.rms_norm(x2, w, eps)
    return y.view(shape)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """SiLU(g) * u elementwise (exact.c ``qx_silu_mul``; reference F.silu(g) * u)."""
    g, u = g.contiguous(), u.contiguous()
    return _SiluMul.apply(g, u) if _needs_grad(g, u) else native.silu_mul(g, u)


def softmax(x: Tensor) -> Tensor:
    """softmax over the last dim (exact.c ``qx_softmax``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    return exact(lambda a: native.softmax(a, log=False), lambda a: torch.softmax(a, -1), x2).view(shape)


def log_softmax(x: Tensor) -> Tensor:
    """log-softmax over the last dim, float32 over the full vocabulary (exact.c ``qx_softmax``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    return exact(lambda a: native.softmax(a, log=True), lambda a: torch.log_softmax(a, -1), x2).view(shape)


def scale_logits(z: Tensor, temperature: float) -> Tensor:
    """z / T (z itself at T = 1), one elementwise IEEE division on both sides."""
    return z if temperature == 1.0 else z / temperature


# ------------------------------------------------------------------------------------------------------ rope
def rope_tables(max_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """float32 (cos [L, D], sin_signed [L, D]) for positions 0..L-1, HF's default RoPE: inv_freq_i = 1 /
    theta^(2i / D), angle = pos * inv_freq, duplicated over the two halves; sin_signed = [-sin | sin]. Both sides
    build them with the model's max_position_embeddings as L, so the same call makes the same bits."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    return emb.cos(), torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], dim=-1)


def rope(x_THD: Tensor, cos_TD: Tensor, sin_TD: Tensor) -> Tensor:
    """x * cos + roll(x, D/2) * sin_signed (= HF's x * cos + rotate_half(x) * sin), per head."""
    return x_THD * cos_TD[:, None] + torch.roll(x_THD, x_THD.shape[-1] // 2, dims=-1) * sin_TD[:, None]


# ------------------------------------------------------------------------------------------------- attention
def _causal_ref(q_BSHD: Tensor, k_BSGD: Tensor, v_BSGD: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale, causal) v with grouped KV heads: torch's SDPA (its CPU kernel and backward; the
    reference's gradient, not its bits, is what is used)."""
    o = F.scaled_dot_product_attention(q_BSHD.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2),
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def attention_causal(q_BSHD: Tensor, k_BSGD: Tensor, v_BSGD: Tensor) -> Tensor:
    """Causal attention of whole sequences: position s of row b over keys 0..s of row b (exact.c
    ``qx_attention``; the engine's decode and prefill read the same keys in the same order)."""
    b, s, h, d = q_BSHD.shape
    g = k_BSGD.shape[2]
    scale = d**-0.5

    def fast(q, k, v):
        kbase = (torch.arange(b)[:, None] * (s * g * d)).expand(b, s).reshape(-1)
        nkeys = (torch.arange(s)[None] + 1).expand(b, s).reshape(-1)
        return native.attention(q.reshape(b * s, h, d), k, v, kbase, nkeys, g, g * d, d, scale).view(b, s, h, d)

    return exact(fast, lambda q, k, v: _causal_ref(q, k, v, scale), q_BSHD.contiguous(), k_BSGD.contiguous(),
                 v_BSGD.contiguous())


# ------------------------------------------------------------------------------------------------------- MoE
def route(logits_TE: Tensor, top_k: int, norm_topk: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(expert ids [T, k] ascending, their weights [T, k] float32, the ids in top-k order [T, k]) from router
    logits: p = softmax(logits); the k largest p by a stable descending sort (a tie goes to the lower expert id);
    with ``norm_topk`` w = p_k / (p_1 + ... + p_k) (summed in top-k order); then ordered by expert id."""
    probs = softmax(logits_TE)
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = probs.gather(-1, order)
    if norm_topk:
        top = top / sum_chunks(top)[:, None]
    ids, perm = torch.sort(order, dim=-1)
    return ids, top.gather(-1, perm), order


def combine(w_TK: Tensor, y_TKH: Tensor) -> Tensor:
    """sum_k w_k * y_k, k ascending (expert order), float32: acc = w_0 y_0; acc = acc + w_k y_k."""
    ys, ws = y_TKH.unbind(1), w_TK.unbind(1)  # one op each (k slices would each take a zero-filled gradient)
    acc = ws[0][:, None] * ys[0]
    for k in range(1, len(ys)):
        acc = acc + ws[k][:, None] * ys[k]
    return acc


def quant_act(x: Tensor, scheme: str, group: int | None) -> Tensor:
    """The activation a W8A8 linear multiplies: quantized per token (INT8) or per token and group (FP8) with the
    one quantizer's formulas, dequantized in float32, straight-through gradient; other schemes: ``x``."""
    if scheme == "w8a8_int8":
        with torch.no_grad():
            fq = dequant_act_int8_per_token(*quant_act_int8_per_token(x), torch.float32)
    elif scheme == "w8a8_fp8":
        with torch.no_grad():
            fq = dequant_act_fp8_per_token_group(*quant_act_fp8_per_token_group(x, group), torch.float32)
    else:
        return x
    return straight_through(x, fq) if x.requires_grad else fq
