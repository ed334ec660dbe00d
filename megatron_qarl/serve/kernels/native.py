"""The engine's native low-bit kernels (``int8_gemv.c``, ``int4_gemv.c``, ``fp8_gemv.c``), loaded with ctypes.

Why they exist (measured by benchmarks/decode.py, BENCHMARKS.md): at decode a token meets 2 x top-k expert
GEMMs per layer, each 0.8-3 MB of low-bit codes, and torch's low-bit kernels left W4A16 and INT8 short of the
speedup their bytes allow over BF16, or far behind it:
- INT8: oneDNN's quantized linear costs a fixed ~15 us per call beyond the GEMM, quantizing the activation
  takes ~25 us of small torch ops; on CPUs without AVX512-VNNI (AVX2 only) its u8s8 kernel is ~280x slower
  than BF16 and adds pairs of products in saturating int16 (oneDNN, "Nuances of int8 computations").
- W4A16: torch's int4 kernel streams at ~55% of the bf16 kernel's rate.
- FP8: torch's CPU fp8 GEMM is a reference path; without these kernels the engine dequantizes the weights to
  bf16 at load and reads 2 bytes per weight.
These kernels read the checkpoint's own tensors in place (int8 codes [N, K]; compressed-tensors int32 words as
bytes; e4m3 codes as bytes), take one row or a few rows of activations per call (a weight row is read once
for all of them), run all k experts of a token in one call (one OpenMP region), quantize the activation
themselves where the scheme does (the learner's formulas, bit for bit), and apply the scales on the way out.

One build holds every instruction set (qarl_simd.h): AVX-512 (VNNI for int8, BF16 for int4, F for fp8), AVX2
(with FMA and F16C) and plain C. ``Kernels.isas(fmt)`` lists what this CPU runs, best first; the engine
(linear.py) picks per layer and logs its choice. ``QARL_NATIVE_ISA=avx2`` caps the choice at AVX2 (an
AVX-512 machine then runs what an AVX2-only one runs: tests, benchmarks).

Built on first use with the system C compiler (``cc -O3 -ffp-contract=off -fopenmp``, ~2 s; no torch headers)
into ``$QARL_KERNEL_CACHE`` (default ``~/.cache/megatron_qarl/kernels``), keyed by the sources' hash and the
machine, written atomically so concurrent servers share one build. The OpenMP runtime is the one torch
already loaded (same soname, libgomp.so.1). Without a compiler, if the build fails, or with
``QARL_NATIVE_KERNELS=0``, ``load()`` returns None and the engine keeps torch's kernels (the reason logged
once). tests/test_rollout_native.py checks every kernel against exact references.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from megatron_qarl.utils.cbuild import cache_dir, compile_shared

log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
SOURCES = [_HERE / f for f in ("qarl_cpu.c", "int8_gemv.c", "int4_gemv.c", "fp8_gemv.c")]
HEADERS = [_HERE / "qarl_bf16.h", _HERE / "qarl_simd.h"]  # included by the sources: part of the cache key
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
ISA_CODES = {"plain": 0, "avx2": 1, "avx512": 2}  # qarl_simd.h QARL_ISA_*
_CPU_AVX2, _CPU_AVX512, _CPU_VNNI, _CPU_BF16 = 1, 2, 4, 8  # qarl_simd.h QARL_CPU_*
# every kernel's trailing arguments: weights, scales, n, col, R, diag, out, ld, out_bf16, threads
_GEMM_ARGS = [_P, _P, _P, _P, _I64, _INT, _P, _I64, _INT, _INT]
ERRORS = {-2: (MemoryError, "out of memory for the activation's copy"),
          -3: (RuntimeError, "this build has no such instruction set")}


class Kernels:
    """ctypes bindings of the kernels (see the C files for the formulas).

    ``vnni`` / ``int4_ok`` / ``avx512``: this CPU runs the AVX-512 int8 (VNNI) / int4 (BF16) / fp8 kernels;
    ``avx2``: the AVX2 ones (all three formats). ``QARL_NATIVE_ISA=avx2`` clears the AVX-512 ones."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.lib, self.path = lib, path
        lib.qarl_int8_gemm.argtypes = [_INT, _P, _INT, _I64, _I64, *_GEMM_ARGS]
        lib.qarl_int8_gemm_codes_plain.argtypes = [_P, _P, _I64, _I64, _P, _P, _P, _P, _I64, _INT, _P, _I64]
        lib.qarl_quant_int8.argtypes = [_INT, _P, _INT, _I64, _I64, _P, _P]
        lib.qarl_int4_gemm.argtypes = [_INT, _P, _I64, _I64, _I64, *_GEMM_ARGS]
        lib.qarl_fp8_gemm.argtypes = [_INT, _P, _INT, _I64, _I64, _I64, *_GEMM_ARGS]
        lib.qarl_quant_fp8.argtypes = [_INT, _P, _INT, _I64, _I64, _I64, _P, _P]
        features = int(lib.qarl_cpu_features())
        cap = os.environ.get("QARL_NATIVE_ISA", "best")
        if cap not in ("best", "avx2"):
            raise ValueError(f"QARL_NATIVE_ISA={cap!r}: expected 'best' (default) or 'avx2'")
        if cap == "avx2":
            features &= _CPU_AVX2
        self.avx2 = bool(features & _CPU_AVX2)
        self.avx512 = bool(features & _CPU_AVX512)
        self.vnni = bool(features & _CPU_VNNI)
        self.int4_ok = bool(features & _CPU_BF16)

    def isas(self, fmt: str) -> list[str]:
        """The instruction sets this CPU runs for ``fmt`` (int8, int4, fp8), fastest first; "plain" is the C
        loop every machine runs (the tests' reference; slower than torch's kernels)."""
        fast = {"int8": self.vnni, "int4": self.int4_ok, "fp8": self.avx512}[fmt]
        return ["avx512"] * fast + ["avx2"] * self.avx2 + ["plain"]

    def gemm(self, fmt: str, weights: list[Tensor], scales: list[Tensor], out_dtype: torch.dtype, diag: bool = False,
             isa: str | None = None, block: int = 0) -> Gemm:
        """A GEMM of ``fmt`` over these linears, set up once (see ``Gemm``); ``block``: int4's group, fp8's block."""
        return Gemm(self, fmt, weights, scales, out_dtype, diag, isa, block)

    def int8(self, x_TK: Tensor, codes: list[Tensor], scales: list[Tensor], out_dtype: torch.dtype,
             diag: bool = False, isa: str | None = None) -> Tensor:
        """W8A8-INT8 (int8_gemv.c) in ``out_dtype`` (fp32 or bf16): the activation ``x_TK`` (fp32 or bf16),
        quantized per token as the learner does, through the linears of int8 codes [N, K] ``codes[r]`` and fp32
        scales [N] ``scales[r]``."""
        return Gemm(self, "int8", codes, scales, out_dtype, diag, isa)(x_TK)

    def int4(self, x_TK: Tensor, packed: list[Tensor], scales: list[Tensor], group: int, out_dtype: torch.dtype,
             diag: bool = False, isa: str | None = None) -> Tensor:
        """W4A16 (int4_gemv.c): the bf16 activation through the linears of 4-bit fields ``packed[r]`` (uint8
        [N, K/2], the int32 words' bytes) and bf16 scales [N, K/group] ``scales[r]``."""
        return Gemm(self, "int4", packed, scales, out_dtype, diag, isa, group)(x_TK)

    def fp8(self, x_TK: Tensor, codes: list[Tensor], scales: list[Tensor], block: int, out_dtype: torch.dtype,
            diag: bool = False, isa: str | None = None) -> Tensor:
        """W8A8-FP8 (fp8_gemv.c): the activation (fp32 or bf16), quantized per token and group of ``block`` as
        the learner does, through the linears of float8_e4m3fn codes [N, K] ``codes[r]`` (as uint8) and fp32
        block scales [ceil(N/block), K/block] ``scales[r]`` (weight_scale_inv)."""
        return Gemm(self, "fp8", codes, scales, out_dtype, diag, isa, block)(x_TK)

    def int8_quant(self, x_TK: Tensor, isa: str = "plain") -> tuple[Tensor, Tensor]:
        """The int8 kernel's own per-token quantization: (int8 codes [T, K], fp32 scales [T, 1])."""
        x_TK = x_TK.contiguous()
        q = torch.empty(x_TK.shape, dtype=torch.int8)
        s = torch.empty((x_TK.shape[0], 1), dtype=torch.float32)
        if self.lib.qarl_quant_int8(ISA_CODES[isa], x_TK.data_ptr(), _is_bf16(x_TK, "int8"), *x_TK.shape, q.data_ptr(),
                                    s.data_ptr()):
            raise ValueError(f"int8 quantization: empty activation {list(x_TK.shape)}")
        return q, s

    def fp8_quant(self, x_TK: Tensor, block: int, isa: str = "plain") -> tuple[Tensor, Tensor]:
        """The fp8 kernel's own per-token-group quantization: (the codes' values as fp32 [T, K], fp32 scales
        [T, K/block])."""
        x_TK = x_TK.contiguous()
        q = torch.empty(x_TK.shape, dtype=torch.float32)
        s = torch.empty((x_TK.shape[0], x_TK.shape[1] // block), dtype=torch.float32)
        if self.lib.qarl_quant_fp8(ISA_CODES[isa], x_TK.data_ptr(), _is_bf16(x_TK, "fp8"), *x_TK.shape, block,
                                   q.data_ptr(), s.data_ptr()):
            raise ValueError(f"fp8 quantization: block {block} does not divide K of {list(x_TK.shape)}")
        return q, s

    def int8_plain(self, q_TK: Tensor, s_T1: Tensor, codes: list[Tensor], scales: list[Tensor],
                   diag: bool = False) -> Tensor:
        """The product of given int8 codes by the plain C loop (fp32): the tests' reference for SIMD."""
        q_TK, s_T1 = q_TK.contiguous(), s_T1.contiguous()
        t, r, ns = q_TK.shape[0], len(codes), [c.shape[0] for c in codes]
        out = torch.empty((r, ns[0]) if diag else (t, sum(ns)), dtype=torch.float32)
        cols = [0] * r if diag else [sum(ns[:i]) for i in range(r)]
        if self.lib.qarl_int8_gemm_codes_plain(q_TK.data_ptr(), s_T1.data_ptr(), *q_TK.shape, _ptrs(codes),
                                               _ptrs(scales), (_I64 * r)(*ns), (_I64 * r)(*cols), r, int(diag),
                                               out.data_ptr(), out.shape[1]):
            raise ValueError(f"int8 plain: {t} activation rows for {r} linears")
        return out


class Gemm:
    """One native GEMM over fixed linears, set up once: the kernel and instruction set, the C arrays of the
    weights' and scales' pointers, N and output columns per linear (a layer keeps one between weight updates:
    ~4 us a call instead of ~8). ``gemm(x_TK)``: diag, [R, N] (row r of ``x_TK`` through linear r); else
    [T, sum of N] (every row through every linear, side by side). Operands must be contiguous CPU tensors,
    checked where they are made (linear.py), not per call; they are kept alive here."""

    def __init__(self, kernels: Kernels, fmt: str, weights: list[Tensor], scales: list[Tensor],
                 out_dtype: torch.dtype, diag: bool = False, isa: str | None = None, block: int = 0):
        isa = isa or kernels.isas(fmt)[0]
        if isa not in kernels.isas(fmt):
            raise RuntimeError(f"{fmt} GEMV: this CPU does not run the {isa} kernel (it runs {kernels.isas(fmt)})")
        ns = [w.shape[0] for w in weights]
        if diag and len(set(ns)) != 1:
            raise ValueError(f"{fmt} GEMV: diag wants linears of one N, got {ns}")
        r = len(weights)
        self.fmt, self.diag, self.out_dtype, self.ns, self.block = fmt, diag, out_dtype, ns, block
        self.keep = weights, scales
        self.fn = getattr(kernels.lib, f"qarl_{fmt}_gemm")
        self.isa = ISA_CODES[isa]
        self.tail = (_ptrs(weights), _ptrs(scales), (_I64 * r)(*ns),
                     (_I64 * r)(*([0] * r if diag else [sum(ns[:i]) for i in range(r)])), r, int(diag))
        self.out_bf16 = int(out_dtype == torch.bfloat16)

    def __call__(self, x_TK: Tensor) -> Tensor:
        x_TK = x_TK.contiguous()
        t, k = x_TK.shape if x_TK.dim() == 2 else (0, 0)
        if self.fmt == "int4":
            if x_TK.dtype != torch.bfloat16 or x_TK.dim() != 2:
                raise ValueError(f"int4 GEMV: activation must be a 2-D bf16 tensor, got {x_TK.dtype} "
                                 f"{list(x_TK.shape)}")
            head: tuple = (x_TK.data_ptr(), t, k, self.block)
        else:
            head = (x_TK.data_ptr(), _is_bf16(x_TK, self.fmt), t, k) + ((self.block,) if self.fmt == "fp8" else ())
        r = len(self.ns)
        if self.diag and t != r:
            raise ValueError(f"{self.fmt} GEMV: {t} activation rows for {r} linears (diag wants one row per linear)")
        out = torch.empty((r, self.ns[0]) if self.diag else (t, sum(self.ns)), dtype=self.out_dtype)
        args = (self.isa, *head, *self.tail, out.data_ptr(), out.shape[1], self.out_bf16, torch.get_num_threads())
        if torch.autograd._profiler_enabled():  # visible to torch.profiler as one op (benchmarks/decode.py)
            with torch.profiler.record_function("native low-bit GEMV"):
                rc = self.fn(*args)
        else:
            rc = self.fn(*args)
        if rc == -1:
            raise ValueError(f"{self.fmt} GEMV: unsupported shape (activation {list(x_TK.shape)}, {r} linears of "
                             f"N {self.ns}, block {self.block})")
        if rc:
            cls, why = ERRORS.get(rc, (RuntimeError, f"error {rc}"))
            raise cls(f"{self.fmt} GEMV: {why}")
        return out


def _ptrs(tensors: list[Tensor]) -> ctypes.Array:
    """The C array of the tensors' data pointers (one per linear)."""
    return (_P * len(tensors))(*[t.data_ptr() for t in tensors])


def _is_bf16(x: Tensor, name: str) -> int:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise ValueError(f"{name} GEMV: activation must be a 2-D fp32 or bf16 tensor, got {x.dtype} {list(x.shape)}")
    return int(x.dtype == torch.bfloat16)


_LOADED: dict[str, Kernels | None] = {}


def _cpu_id() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernels for this machine (or return the cached build). Raises RuntimeError on failure."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(src + cc.encode()).hexdigest()[:12]
    lib = (out_dir or cache_dir()) / f"qarl_kernels-{key}-{_cpu_id()}.so"
    return compile_shared(cc, ["-O3", "-ffp-contract=off", "-fopenmp"], SOURCES, lib)


def load() -> Kernels | None:
    """The kernels, built on first use; None (reason logged once) where they cannot be had."""
    if "lib" in _LOADED:
        return _LOADED["lib"]
    kernel = None
    if os.environ.get("QARL_NATIVE_KERNELS", "1") == "0":
        log.info("native kernels off (QARL_NATIVE_KERNELS=0): torch's low-bit kernels")
    elif platform.system() != "Linux":
        log.info("native kernels: built on Linux only; torch's low-bit kernels")
    else:
        try:
            path = build()
            kernel = Kernels(ctypes.CDLL(str(path)), path)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            log.warning("native kernels unavailable, torch's low-bit kernels instead: %s", err)
    _LOADED["lib"] = kernel
    return kernel
