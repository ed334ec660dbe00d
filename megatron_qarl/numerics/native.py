"""The exact kernels (``exact.c``) built and bound with ctypes, as serve/kernels/native.py builds the engine's
low-bit ones.

Built on first use with the system C compiler (``cc -O3 -ffp-contract=off -fopenmp``: no fused multiply-add, no
``-ffast-math``) into ``$QARL_KERNEL_CACHE`` (default ``~/.cache/megatron_qarl/kernels``), keyed by the source's
hash and the compiler, written atomically so concurrent processes share one build. Unlike the low-bit kernels
there is no fallback: exact numerics without these kernels would not be exact, so ``load()`` raises, naming why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from megatron_qarl.utils.cbuild import cache_dir, compile_shared

SOURCE = Path(__file__).with_name("exact.c")
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_LIB: list[ctypes.CDLL] = []


def build(out_dir: Path | None = None) -> Path:
    """Compile ``exact.c`` (or return the cached build). Raises RuntimeError naming the failure."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("numerics: exact needs a C compiler (cc / gcc) on PATH to build megatron_qarl/numerics/"
                           "exact.c")
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
    # keyed by the source, the compiler, the flags and the architecture: a cache shared by nodes of different kinds
    # never hands one the other's build
    key = hashlib.sha256(SOURCE.read_bytes() + f"{cc} {flags} {platform.machine()}".encode()).hexdigest()[:12]
    lib = (out_dir or cache_dir()) / f"qarl_exact-{key}.so"
    return compile_shared(cc, flags, [SOURCE], lib)


def lib() -> ctypes.CDLL:
    """The bound library (built on first use)."""
    if not _LIB:
        cdll = ctypes.CDLL(str(build()))
        cdll.qx_linear.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _INT, _P, _INT]
        cdll.qx_rmsnorm.argtypes = [_P, _I64, _I64, _P, _F, _P, _INT]
        cdll.qx_silu_mul.argtypes = [_P, _P, _I64, _P, _INT]
        cdll.qx_softmax.argtypes = [_P, _I64, _I64, _INT, _P, _INT]
        cdll.qx_attention.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _F, _P, _INT]
        cdll.qx_rmsnorm_bwd.argtypes = [_P, _P, _I64, _I64, _P, _F, _P, _P, _INT]
        cdll.qx_silu_mul_bwd.argtypes = [_P, _P, _P, _I64, _P, _P, _INT]
        cdll.qx_round_bf16.argtypes = [_P, _I64, _P, _INT]
        cdll.qx_attn_block.argtypes = [_P, _I64, _I64, _P, _F, _P, _INT, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64,
                                       _I64, _I64, _I64, _F, _P, _INT, _I64, _I64, _INT, _INT, _F, _F, _INT]
        cdll.qx_kv_round.argtypes = [_P, _I64, _INT, _F, _INT, _P]
        cdll.qx_moe_block.argtypes = [_P, _I64, _I64, _P, _F, _P, _I64, _I64, _INT, _P, _P, _I64, _INT, _I64, _INT,
                                      _I64, _I64, _INT, _P, _INT]
        _LIB.append(cdll)
    return _LIB[0]


def _checked(t: Tensor, name: str) -> Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: exact kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
    return t


def _f32(t: Tensor, name: str) -> Tensor:
    return _checked(t, name).contiguous()


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise MemoryError(f"{what}: out of memory")
    if rc:
        raise ValueError(f"{what}: unsupported shape (error {rc})")


SMALL_WORK = 1 << 20  # multiply-adds below which a call runs on one thread (an OpenMP region costs more there)


def _threads(work: int = SMALL_WORK) -> int:
    """Threads for a call of ``work`` multiply-adds (each output is computed by one thread whichever: the count
    changes no bit)."""
    return torch.get_num_threads() if work >= SMALL_WORK else 1


def linear(x_MK: Tensor, w_NK: Tensor, chunk: int, partials: bool = False) -> Tensor:
    """``qx_linear``: [M, N] (chunks summed in order) or the chunk partials [M, N, K / chunk]."""
    x_MK, w_KN = _f32(x_MK, "linear input"), transposed(_checked(w_NK, "linear weight"))
    (m, k), n = x_MK.shape, w_KN.shape[1]
    if w_KN.shape[0] != k:
        raise ValueError(f"linear: input K {k} != weight K {w_KN.shape[0]}")
    out = torch.empty((m, n, k // chunk) if partials else (m, n), dtype=torch.float32)
    _check(lib().qx_linear(x_MK.data_ptr(), m, k, w_KN.data_ptr(), n, chunk, int(partials), out.data_ptr(),
                           _threads(m * n * k)), f"linear [{m}, {k}] x [{n}, {k}] chunk {chunk}")
    return out


def transposed(w_NK: Tensor) -> Tensor:
    """w.T contiguous (the kernel's K-major operand), kept on the tensor while its version counter and storage are
    unchanged. That key is not enough for a learner's parameter: Megatron's distributed optimizer refreshes the
    parameters a data-parallel rank does not own by an all-gather into the param buffer, which leaves their
    ``_version`` as it was, so the learner drops these copies after every weight change (``forget_transposed``,
    from ``moe.exact.ExactForward.invalidate``). The engine's weights are inference tensors (no version counter)
    rebuilt at each weight update rather than modified, and each is the transposed view of a K-major tensor, which
    costs no copy."""
    version = (-1 if w_NK.is_inference() else w_NK._version, w_NK.data_ptr())
    held = getattr(w_NK, "_qx_t", None)
    if held is not None and held[0] == version:
        return held[1]
    w_KN = w_NK.t().contiguous()
    w_NK._qx_t = (version, w_KN)
    return w_KN


def forget_transposed(tensors: Iterable[Tensor]) -> None:
    """Drop the K-major copies ``transposed`` keeps on ``tensors``: their values may have changed without a version
    bump (see ``transposed``), and a stale copy would make the next forward compute with the old weights."""
    for t in tensors:
        if getattr(t, "_qx_t", None) is not None:
            t._qx_t = None


def rms_norm(x_MH: Tensor, w_H: Tensor, eps: float) -> Tensor:
    x_MH, w_H = _f32(x_MH, "rms_norm input"), _f32(w_H, "rms_norm weight")
    out = torch.empty_like(x_MH)
    _check(lib().qx_rmsnorm(x_MH.data_ptr(), *x_MH.shape, w_H.data_ptr(), eps, out.data_ptr(),
                            _threads(x_MH.numel() * 4)),
           "rms_norm")
    return out


def rms_norm_backward(x_MH: Tensor, w_H: Tensor, eps: float, g_MH: Tensor) -> tuple[Tensor, Tensor]:
    """``qx_rmsnorm_bwd``: (the input's gradient, x / rms(x)) of ``rms_norm`` at the output gradient ``g_MH``."""
    x_MH, w_H, g_MH = _f32(x_MH, "rms_norm input"), _f32(w_H, "rms_norm weight"), _f32(g_MH, "rms_norm gradient")
    gx, xhat = torch.empty_like(x_MH), torch.empty_like(x_MH)
    _check(lib().qx_rmsnorm_bwd(x_MH.data_ptr(), g_MH.data_ptr(), *x_MH.shape, w_H.data_ptr(), eps, gx.data_ptr(),
                                xhat.data_ptr(), _threads(x_MH.numel() * 8)), "rms_norm backward")
    return gx, xhat


def silu_mul_backward(g: Tensor, u: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``qx_silu_mul_bwd``: the gradients of ``silu_mul(g, u)`` at the output gradient ``grad``."""
    g, u, grad = _f32(g, "silu gate"), _f32(u, "silu up"), _f32(grad, "silu gradient")
    dg, du = torch.empty_like(g), torch.empty_like(u)
    _check(lib().qx_silu_mul_bwd(g.data_ptr(), u.data_ptr(), grad.data_ptr(), g.numel(), dg.data_ptr(), du.data_ptr(),
                                 _threads(g.numel() * 16)), "silu_mul backward")
    return dg, du


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    g, u = _f32(g, "silu gate"), _f32(u, "silu up")
    out = torch.empty_like(g)
    _check(lib().qx_silu_mul(g.data_ptr(), u.data_ptr(), g.numel(), out.data_ptr(), _threads(g.numel() * 16)),
           "silu_mul")
    return out


def round_bf16(x: Tensor) -> Tensor:
    """``qx_round_bf16``: x rounded to bfloat16 (nearest even) and held in float32, the bits of x.to(bf16).float()
    (a NaN becomes c10's quiet NaN, where torch's vectorized conversion writes another NaN)."""
    x = _f32(x, "round input")
    out = torch.empty_like(x)
    _check(lib().qx_round_bf16(x.data_ptr(), x.numel(), out.data_ptr(), _threads(x.numel() * 4)), "round")
    return out


KV_FORMATS = {None: 0, "auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}  # exact.c's kv_fmt


def kv_round(x: Tensor, kv_dtype: str, scale: float, act: torch.dtype) -> Tensor:
    """``qx_kv_round``: qat/kv_cache.py's ``kv_round_trip`` in C (the exact engine's attention block applies it to
    the keys and values it caches), held in float32: x = act(fp8(act(x / scale)) * scale)."""
    x = _f32(x, "kv round input")
    out = torch.empty_like(x)
    _check(lib().qx_kv_round(x.data_ptr(), x.numel(), KV_FORMATS[kv_dtype], scale, _act_bf16(act, 1, "kv round"),
                             out.data_ptr()), "kv round")
    return out


def softmax(x_MV: Tensor, log: bool) -> Tensor:
    x_MV = _f32(x_MV, "softmax input")
    out = torch.empty_like(x_MV)
    _check(lib().qx_softmax(x_MV.data_ptr(), *x_MV.shape, int(log), out.data_ptr(), _threads(x_MV.numel() * 16)),
           "softmax")
    return out


def attention(q_RHD: Tensor, k: Tensor, v: Tensor, kbase_R: Tensor, nkeys_R: Tensor, hkv: int, ls: int, hs: int,
              scale: float) -> Tensor:
    """``qx_attention`` (see exact.c); ``k`` and ``v`` are read through element offsets, so they must be
    contiguous tensors of the same shape."""
    q_RHD = _f32(q_RHD, "attention query")
    if not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape or k.dtype != torch.float32:
        raise ValueError("attention: keys and values must be contiguous float32 tensors of one shape")
    kbase_R, nkeys_R = kbase_R.to(torch.int64).contiguous(), nkeys_R.to(torch.int64).contiguous()
    r, hq, d = q_RHD.shape
    out = torch.empty_like(q_RHD)
    _check(lib().qx_attention(q_RHD.data_ptr(), r, hq, hkv, d, k.data_ptr(), v.data_ptr(), kbase_R.data_ptr(),
                              nkeys_R.data_ptr(), ls, hs, scale, out.data_ptr(),
                              _threads(int(nkeys_R.sum()) * hq * d * 2)), "attention")
    return out


_QUANT = {"bf16": 0, "w8a8_int8": 1, "w8a8_fp8": 2}  # exact.c qx_quant_act's codes


def _quant(scheme: str, group: int | None, k: int, what: str) -> tuple[int, int]:
    """(code, group) of ``ops.quant_act``'s scheme for exact.c; ValueError where the group does not divide K."""
    code = _QUANT[scheme]
    if code == 2 and (not group or k % group):
        raise ValueError(f"{what}: fp8 activation group {group} does not divide K={k}")
    return code, int(group or 0)


def _act_bf16(act: torch.dtype, chunk: int, what: str) -> int:
    """exact.c's rounding flag for the activation dtype (bf16: round; float32: none); ValueError on any other dtype
    or a chunk that is not positive."""
    if act not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{what}: activations are rounded to bfloat16 or kept float32, not {act}")
    if chunk <= 0:
        raise ValueError(f"{what}: chunk {chunk} must be positive")
    return int(act == torch.bfloat16)


def _kmajor(w_NK: Tensor, k: int, what: str) -> Tensor:
    w_NK = _checked(w_NK, what)
    if w_NK.dim() != 2 or w_NK.shape[1] != k:
        raise ValueError(f"{what}: expected a float32 [N, {k}] weight, got {list(w_NK.shape)}")
    return transposed(w_NK)


def _residual(x_RH: Tensor, hidden: int, what: str) -> int:
    """The row count of a block's residual stream (updated in place: contiguous float32 [R, hidden])."""
    if x_RH.dtype != torch.float32 or not x_RH.is_contiguous() or x_RH.dim() != 2 or x_RH.shape[1] != hidden:
        raise ValueError(f"{what}: x must be contiguous float32 [R, {hidden}], got {x_RH.dtype} {list(x_RH.shape)}")
    return x_RH.shape[0]


class CacheRows:
    """The cache entries (slot, position) of a forward's rows, checked once for every layer's ``AttnBlock``: int64,
    inside a cache of ``slots`` x ``seq``, no two rows at one entry (they would write it together)."""

    def __init__(self, pos_R: Tensor, slot_R: Tensor, slots: int, seq: int):
        if pos_R.is_floating_point() or slot_R.is_floating_point():
            raise ValueError(f"cache rows: positions ({pos_R.dtype}) and slots ({slot_R.dtype}) must be integers")
        self.pos, self.slot = pos_R.to(torch.int64).contiguous(), slot_R.to(torch.int64).contiguous()
        self.shape, r = (slots, seq), self.pos.numel()
        if self.slot.shape != self.pos.shape or self.pos.dim() != 1:
            raise ValueError(f"cache rows: positions {list(pos_R.shape)} and slots {list(slot_R.shape)}")
        if r and (int(self.slot.min()) < 0 or int(self.slot.max()) >= slots or int(self.pos.min()) < 0
                  or int(self.pos.max()) >= seq):
            raise ValueError(f"cache rows: slots {int(self.slot.min())}..{int(self.slot.max())} / positions "
                             f"{int(self.pos.min())}..{int(self.pos.max())} outside a cache of {slots} x {seq}")
        if r > 1 and torch.unique(self.slot * seq + self.pos).numel() < r:
            raise ValueError("cache rows: two rows of one forward at the same (slot, position)")


class AttnBlock:
    """``qx_attn_block`` of one layer, its operands set up once (the engine keeps one per layer until the next
    weight update): ``block(x_RH, rows)`` updates the residual stream ``x_RH`` in place and writes the rows' keys and
    values into the float32 caches ``kc``, ``vc`` [slots, Hkv, S, D] at ``rows`` (``CacheRows`` of that shape).
    ``*_q``: ``ops.quant_act``'s (scheme, group) of the linear's input."""

    def __init__(self, ln: Tensor, eps: float, w_qkv: Tensor, qkv_q: tuple[str, int | None], q_norm: Tensor,
                 k_norm: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor, hq: int, w_o: Tensor,
                 o_q: tuple[str, int | None], chunk: int, act: torch.dtype,
                 kv: tuple[str, float, float] = ("auto", 1.0, 1.0)):
        """``kv``: the FP8 cache's (format, k_scale, v_scale) the cached keys and values are rounded as."""
        hidden = ln.shape[0]
        slots, hkv, seq, d = kc.shape
        if vc.shape != kc.shape or not (kc.is_contiguous() and vc.is_contiguous()) or kc.dtype != torch.float32:
            raise ValueError("attention block: the caches must be contiguous float32 tensors of one shape")
        if cos.shape[1] != d or sin.shape != cos.shape or cos.shape[0] < seq:
            raise ValueError(f"attention block: rope tables {list(cos.shape)} for head dim {d} and {seq} positions")
        if ln.shape != (hidden,) or q_norm.shape != (d,) or k_norm.shape != (d,):
            raise ValueError(f"attention block: norm weights {list(ln.shape)}, {list(q_norm.shape)}, "
                             f"{list(k_norm.shape)} for hidden {hidden} and head dim {d}")
        qkv_t, o_t = _kmajor(w_qkv, hidden, "qkv weight"), _kmajor(w_o, hq * d, "o weight")
        if qkv_t.shape[1] != (hq + 2 * hkv) * d or o_t.shape[1] != hidden:
            raise ValueError(f"attention block: qkv {list(w_qkv.shape)} / o {list(w_o.shape)} for {hq} + 2 x {hkv} "
                             f"heads of {d}, hidden {hidden}")
        self.keep = [_f32(t, n) for t, n in ((ln, "norm"), (q_norm, "q norm"), (k_norm, "k norm"), (cos, "cos"),
                                             (sin, "sin"))] + [qkv_t, o_t, kc, vc]
        ln, q_norm, k_norm, cos, sin = self.keep[:5]
        self.hidden, self.slots, self.seq = hidden, slots, seq
        self.work = hidden * (hq + 2 * hkv) * d * 2
        self.head = (ln.data_ptr(), eps, qkv_t.data_ptr(), *_quant(*qkv_q, hidden, "qkv input"), q_norm.data_ptr(),
                     k_norm.data_ptr(), cos.data_ptr(), sin.data_ptr())
        self.tail = (kc.data_ptr(), vc.data_ptr(), seq, hq, hkv, d, d**-0.5, o_t.data_ptr(),
                     *_quant(*o_q, hq * d, "o input"), chunk, _act_bf16(act, chunk, "attention block"),
                     KV_FORMATS[kv[0]], kv[1], kv[2])

    def __call__(self, x_RH: Tensor, rows: CacheRows) -> None:
        r = _residual(x_RH, self.hidden, "attention block")
        if rows.shape != (self.slots, self.seq) or rows.pos.numel() != r:
            raise ValueError(f"attention block: {rows.pos.numel()} cache rows of a {rows.shape} cache for {r} rows of "
                             f"a {(self.slots, self.seq)} one")
        if r == 0:
            return
        _check(lib().qx_attn_block(x_RH.data_ptr(), r, self.hidden, *self.head, rows.pos.data_ptr(),
                                   rows.slot.data_ptr(), *self.tail, _threads(r * self.work)), "attention block")


class MoeBlock:
    """``qx_moe_block`` of one layer, its operands set up once: ``block(x_RH)`` updates the residual stream in place
    and returns the experts each row chose in top-k order (int64 [R, k])."""

    def __init__(self, ln: Tensor, eps: float, w_router: Tensor, top_k: int, norm_topk: bool, w_gu: list[Tensor],
                 w_down: list[Tensor], gu_q: tuple[str, int | None], down_q: tuple[str, int | None], chunk: int,
                 act: torch.dtype):
        hidden, ffn = ln.shape[0], w_down[0].shape[1]
        router_t = _kmajor(w_router, hidden, "router weight")
        gu_t = [_kmajor(w, hidden, f"expert {e} gate_up weight") for e, w in enumerate(w_gu)]
        down_t = [_kmajor(w, ffn, f"expert {e} down weight") for e, w in enumerate(w_down)]
        experts = router_t.shape[1]
        if len(gu_t) != experts or len(down_t) != experts or not 0 < top_k <= experts:
            raise ValueError(f"moe block: {experts} router outputs, {len(gu_t)} / {len(down_t)} experts, top-k {top_k}")
        if any(t.shape[1] != 2 * ffn for t in gu_t) or any(t.shape[1] != hidden for t in down_t):
            raise ValueError(f"moe block: expert weights do not make [{2 * ffn}, {hidden}] / [{hidden}, {ffn}]")
        if ln.shape != (hidden,):
            raise ValueError(f"moe block: norm weight {list(ln.shape)} for hidden {hidden}")
        ln = _f32(ln, "norm")
        self.gu_p, self.down_p = (_P * experts)(*(t.data_ptr() for t in gu_t)), (_P * experts)(
            *(t.data_ptr() for t in down_t))
        self.keep = [ln, router_t, gu_t, down_t]
        self.hidden, self.top_k = hidden, top_k
        self.work = top_k * hidden * ffn * 3
        self.head = (ln.data_ptr(), eps, router_t.data_ptr(), experts, top_k, int(norm_topk), self.gu_p, self.down_p,
                     ffn, *_quant(*gu_q, hidden, "expert gate_up input"), *_quant(*down_q, ffn, "expert down input"),
                     chunk, _act_bf16(act, chunk, "moe block"))

    def __call__(self, x_RH: Tensor) -> Tensor:
        r = _residual(x_RH, self.hidden, "moe block")
        order = torch.empty((r, self.top_k), dtype=torch.int64)
        if r == 0:
            return order
        _check(lib().qx_moe_block(x_RH.data_ptr(), r, self.hidden, *self.head, order.data_ptr(),
                                  _threads(r * self.work)), "moe block")
        return order
