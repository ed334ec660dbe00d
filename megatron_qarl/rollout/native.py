"""The engine's native kernels for one-token decode (``int8_gemv.c``, ``int4_gemv.c``), loaded with ctypes.

Why they exist (measured by benchmarks/decode.py, BENCHMARKS.md): at batch 1 a token meets 2 x top-k expert
GEMVs per layer, each 0.8-3 MB of low-bit codes, and torch's low-bit kernels left W4A16 and INT8 short of
the speedup their bytes allow over BF16:
- INT8: oneDNN's quantized linear costs a fixed ~15 us per call beyond the GEMM, and quantizing the
  activation takes ~25 us of small torch ops; ``torch._int_mm`` streams the codes at ~80% of the bf16
  kernel's rate. The int8 step stayed at ~70% of its allowed speedup.
- W4A16: torch's int4 kernel streams at ~55% of the bf16 kernel's rate (table 1).
These kernels read the checkpoint's own tensors in place (int8 codes [N, K]; compressed-tensors int32
words as bytes), run all k experts of a token in one call (one OpenMP region), and apply the scales on
the way out. The int8 kernel quantizes the activation itself with the learner's formula, bit for bit.

Built on first use with the system C compiler (``cc -O3 -march=native -ffp-contract=off -fopenmp``, ~1 s;
no torch headers) into ``$QARL_KERNEL_CACHE`` (default ``~/.cache/megatron_qarl/kernels``), keyed by the
sources' hash and the machine, written atomically so concurrent servers share one build. The OpenMP
runtime is the one torch already loaded (same soname, libgomp.so.1). Without a compiler, if the build
fails, or with ``QARL_NATIVE_KERNELS=0``, ``load()`` returns None and the engine keeps torch's kernels (the
reason logged once). tests/test_rollout_native.py checks both kernels against exact references.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name("int8_gemv.c"), Path(__file__).with_name("int4_gemv.c")]
HEADERS = [Path(__file__).with_name("qarl_bf16.h")]  # included by both: part of the build's cache key
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class Kernels:
    """ctypes bindings of int8_gemv.c and int4_gemv.c (see there for the formulas)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.lib, self.path = lib, path
        lib.qarl_int8_gemv.argtypes = [_P, ctypes.c_int, _I64, _I64, _P, _P, _I64, _I64, _P, ctypes.c_int,
                                       ctypes.c_int]
        lib.qarl_int8_gemv_plain.argtypes = [_P, _P, _I64, _I64, _P, _P, _I64, _I64, _P]
        lib.qarl_quant_int8.argtypes = [_P, ctypes.c_int, _I64, _I64, _P, _P]
        lib.qarl_int4_gemv.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, ctypes.c_int, ctypes.c_int]
        self.vnni = bool(lib.qarl_int8_gemv_has_vnni())
        self.int4_ok = bool(lib.qarl_int4_gemv_supported())  # needs AVX512-BF16; else torch's int4 kernel

    def _run(self, fn, args) -> int:
        if torch.autograd._profiler_enabled():  # visible to torch.profiler as one op (benchmarks/decode.py)
            with torch.profiler.record_function("native low-bit GEMV"):
                return fn(*args)
        return fn(*args)

    def int4(self, x_TK: Tensor, packed: list[Tensor], scales: list[Tensor], group: int,
             out_dtype: torch.dtype) -> Tensor:
        """[R, N]: bf16 row r of ``x_TK`` (or its one row) through W4A16 linear r: ``packed[r]`` its 4-bit
        fields as uint8 [N, K/2] (the int32 words' bytes), ``scales[r]`` bf16 [N, K/group]. Operands must
        be contiguous CPU tensors, checked where they are made (Int4Linear)."""
        r, n = len(packed), packed[0].shape[0]
        x_TK = x_TK.contiguous()
        if x_TK.dtype != torch.bfloat16 or x_TK.dim() != 2:
            raise ValueError(f"int4 GEMV: activation must be a 2-D bf16 tensor, got {x_TK.dtype} {list(x_TK.shape)}")
        out = torch.empty((r, n), dtype=out_dtype)
        args = (x_TK.data_ptr(), x_TK.shape[0], x_TK.shape[1], group, _ptrs(packed), _ptrs(scales), r, n,
                out.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
        rc = self._run(self.lib.qarl_int4_gemv, args)
        if rc == -1:
            raise ValueError(f"int4 GEMV: unsupported shape (K {x_TK.shape[1]}, group {group}, "
                             f"{x_TK.shape[0]} activation rows for {r} linears)")
        _check(rc, x_TK.shape[0], r)
        return out

    def int8(self, x_TK: Tensor, codes: list[Tensor], scales: list[Tensor], out_dtype: torch.dtype) -> Tensor:
        """[R, N] in ``out_dtype`` (fp32 or bf16): row r of the activation ``x_TK`` (fp32 or bf16; or its one
        row), quantized per token as the learner does, through linear r, whose int8 codes [N, K] and fp32
        scales [N] are ``codes[r]``, ``scales[r]``. Operands must be contiguous CPU tensors; the weights'
        are checked where they are made (Int8Linear), not per call."""
        r, n = len(codes), codes[0].shape[0]
        x_TK = x_TK.contiguous()
        out = torch.empty((r, n), dtype=out_dtype)
        args = (x_TK.data_ptr(), _is_bf16(x_TK), x_TK.shape[0], x_TK.shape[1], _ptrs(codes), _ptrs(scales), r, n,
                out.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
        rc = self._run(self.lib.qarl_int8_gemv, args)
        _check(rc, x_TK.shape[0], r)
        return out

    def int8_quant(self, x_TK: Tensor) -> tuple[Tensor, Tensor]:
        """The kernel's own per-token quantization: (int8 codes [T, K], fp32 scales [T, 1])."""
        x_TK = x_TK.contiguous()
        q = torch.empty(x_TK.shape, dtype=torch.int8)
        s = torch.empty((x_TK.shape[0], 1), dtype=torch.float32)
        _check(self.lib.qarl_quant_int8(x_TK.data_ptr(), _is_bf16(x_TK), x_TK.shape[0], x_TK.shape[1], q.data_ptr(),
                                        s.data_ptr()), x_TK.shape[0], 1)
        return q, s

    def int8_plain(self, q_TK: Tensor, s_T1: Tensor, codes: list[Tensor], scales: list[Tensor]) -> Tensor:
        """The product of given codes by the kernel's plain C loop (fp32): the tests' reference for SIMD."""
        r, n = len(codes), codes[0].shape[0]
        out = torch.empty((r, n), dtype=torch.float32)
        rc = self.lib.qarl_int8_gemv_plain(q_TK.contiguous().data_ptr(), s_T1.contiguous().data_ptr(),
                                           q_TK.shape[0], q_TK.shape[1], _ptrs(codes), _ptrs(scales), r, n,
                                           out.data_ptr())
        _check(rc, q_TK.shape[0], r)
        return out


def _ptrs(tensors: list[Tensor]) -> ctypes.Array:
    """The C array of the tensors' data pointers (one per linear)."""
    return (_P * len(tensors))(*[t.data_ptr() for t in tensors])


def _is_bf16(x: Tensor) -> int:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise ValueError(f"int8 GEMV: activation must be a 2-D fp32 or bf16 tensor, got {x.dtype} {list(x.shape)}")
    return int(x.dtype == torch.bfloat16)


def _check(rc: int, x_rows: int, r: int) -> None:
    if rc == -2:
        raise MemoryError("native GEMV: out of memory for the activation's copy")
    if rc == -3:
        raise RuntimeError("int4 GEMV: this build has no AVX512-BF16 (Kernels.int4_ok is False)")
    if rc:
        raise ValueError(f"native GEMV: {x_rows} activation rows for {r} linears (want 1 or {r})")


_LOADED: dict[str, Kernels | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("QARL_KERNEL_CACHE", Path.home() / ".cache" / "megatron_qarl" / "kernels"))


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
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"qarl_kernels-{key}-{_cpu_id()}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [cc, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
               "-o", str(tmp_lib), *map(str, SOURCES)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-800:]}")
        os.replace(tmp_lib, lib)  # atomic: a concurrent build writes the same bytes
    return lib


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
