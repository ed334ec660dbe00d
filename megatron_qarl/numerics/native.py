"""The exact kernels (``exact.c``) built and bound with ctypes, as rollout/native.py builds the engine's low-bit ones.

Built on first use with the system C compiler (``cc -O3 -ffp-contract=off -fopenmp``: no fused multiply-add, no
``-ffast-math``) into ``$QARL_KERNEL_CACHE`` (default ``~/.cache/megatron_qarl/kernels``), keyed by the source's
hash and the compiler, written atomically so concurrent processes share one build. Unlike the low-bit kernels
there is no fallback: exact numerics without these kernels would not be exact, so ``load()`` raises, naming why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
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
    key = hashlib.sha256(SOURCE.read_bytes() + cc.encode()).hexdigest()[:12]
    lib = (out_dir or cache_dir()) / f"qarl_exact-{key}.so"
    return compile_shared(cc, ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"], [SOURCE], lib)


def lib() -> ctypes.CDLL:
    """The bound library (built on first use)."""
    if not _LIB:
        cdll = ctypes.CDLL(str(build()))
        cdll.qx_linear.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _INT, _P, _INT]
        cdll.qx_rmsnorm.argtypes = [_P, _I64, _I64, _P, _F, _P, _INT]
        cdll.qx_silu_mul.argtypes = [_P, _P, _I64, _P, _INT]
        cdll.qx_softmax.argtypes = [_P, _I64, _I64, _INT, _P, _INT]
        cdll.qx_attention.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _F, _P, _INT]
        _LIB.append(cdll)
    return _LIB[0]


def _f32(t: Tensor, name: str) -> Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: exact kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
    return t.contiguous()


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
    x_MK, w_KN = _f32(x_MK, "linear input"), transposed(_f32(w_NK, "linear weight"))
    (m, k), n = x_MK.shape, w_KN.shape[1]
    if w_KN.shape[0] != k:
        raise ValueError(f"linear: input K {k} != weight K {w_KN.shape[0]}")
    out = torch.empty((m, n, k // chunk) if partials else (m, n), dtype=torch.float32)
    _check(lib().qx_linear(x_MK.data_ptr(), m, k, w_KN.data_ptr(), n, chunk, int(partials), out.data_ptr(),
                           _threads(m * n * k)), f"linear [{m}, {k}] x [{n}, {k}] chunk {chunk}")
    return out


def transposed(w_NK: Tensor) -> Tensor:
    """w.T contiguous (the kernel's K-major operand), kept on the tensor while it is not modified in place (the
    engine's weights live across calls, inference tensors rebuilt at each weight update rather than modified; the
    learner's are made per forward)."""
    version = -1 if w_NK.is_inference() else w_NK._version  # inference tensors have no version counter
    held = getattr(w_NK, "_qx_t", None)
    if held is not None and held[0] == version:
        return held[1]
    w_KN = w_NK.t().contiguous()
    w_NK._qx_t = (version, w_KN)
    return w_KN


def rms_norm(x_MH: Tensor, w_H: Tensor, eps: float) -> Tensor:
    x_MH, w_H = _f32(x_MH, "rms_norm input"), _f32(w_H, "rms_norm weight")
    out = torch.empty_like(x_MH)
    _check(lib().qx_rmsnorm(x_MH.data_ptr(), *x_MH.shape, w_H.data_ptr(), eps, out.data_ptr(),
                            _threads(x_MH.numel() * 4)),
           "rms_norm")
    return out


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    g, u = _f32(g, "silu gate"), _f32(u, "silu up")
    out = torch.empty_like(g)
    _check(lib().qx_silu_mul(g.data_ptr(), u.data_ptr(), g.numel(), out.data_ptr(), _threads(g.numel() * 16)),
           "silu_mul")
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
