"""The engine's one native kernel: a W8A8-INT8 GEMV for one-token decode (``int8_gemv.c``), loaded with ctypes.

Why it exists (measured by benchmarks/decode.py, BENCHMARKS.md): at batch 1 a token meets 2 x top-k expert
GEMVs per layer, each 1.5-3 MB of int8 codes. torch's integer kernels cost a fixed ~15 us per call
(oneDNN's quantized linear) or stream the codes at ~80% of the rate the bf16 kernel streams its weights
(``torch._int_mm``), and with a handful of small ops around every call the INT8 step stayed at ~70% of the
speedup its bytes allow over BF16. This kernel reads the checkpoint's own [N, K] codes in place, runs all k
experts of a token in one call (one OpenMP region), and applies both scales on the way out.

Built on first use with the system C compiler (``cc -O3 -march=native -fopenmp``, <1 s; no torch headers)
into ``$QARL_KERNEL_CACHE`` (default ``~/.cache/megatron_qarl/kernels``), keyed by the source's hash and
the machine, and written atomically, so concurrent servers share one build. The OpenMP runtime is the one
torch already loaded (same soname, libgomp.so.1). Without a compiler, or if the build fails, or with
``QARL_NATIVE_KERNELS=0``, ``load()`` returns None and the engine keeps torch's kernels (the reason is
logged once). Same results either way: the integer sums are exact; tests/test_rollout_native.py checks
the kernel against torch.
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
SOURCE = Path(__file__).with_name("int8_gemv.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class Int8Gemv:
    """ctypes binding of int8_gemv.c (see there for the formula)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.lib, self.path = lib, path
        lib.qarl_int8_gemv.argtypes = [_P, ctypes.c_int, _I64, _I64, _P, _P, _I64, _I64, _P, ctypes.c_int,
                                       ctypes.c_int]
        lib.qarl_int8_gemv_plain.argtypes = [_P, _P, _I64, _I64, _P, _P, _I64, _I64, _P]
        lib.qarl_quant_int8.argtypes = [_P, ctypes.c_int, _I64, _I64, _P, _P]
        self.vnni = bool(lib.qarl_int8_gemv_has_vnni())

    def __call__(self, x_TK: Tensor, codes: list[Tensor], scales: list[Tensor], out_dtype: torch.dtype) -> Tensor:
        """[R, N] in ``out_dtype`` (fp32 or bf16): row r of the activation ``x_TK`` (fp32 or bf16; or its one
        row), quantized per token as the learner does, through linear r, whose int8 codes [N, K] and fp32
        scales [N] are ``codes[r]``, ``scales[r]``. Operands must be contiguous CPU tensors; the weights'
        are checked where they are made (Int8Linear), not per call."""
        r, n = len(codes), codes[0].shape[0]
        x_TK = x_TK.contiguous()
        out = torch.empty((r, n), dtype=out_dtype)
        w = (_P * r)(*[c.data_ptr() for c in codes])
        sw = (_P * r)(*[s.data_ptr() for s in scales])
        args = (x_TK.data_ptr(), _is_bf16(x_TK), x_TK.shape[0], x_TK.shape[1], w, sw, r, n, out.data_ptr(),
                int(out_dtype == torch.bfloat16), torch.get_num_threads())
        if torch.autograd._profiler_enabled():  # visible to torch.profiler as one op (benchmarks/decode.py)
            with torch.profiler.record_function("native int8 GEMV"):
                rc = self.lib.qarl_int8_gemv(*args)
        else:
            rc = self.lib.qarl_int8_gemv(*args)
        _check(rc, x_TK.shape[0], r)
        return out

    def quant(self, x_TK: Tensor) -> tuple[Tensor, Tensor]:
        """The kernel's own per-token quantization: (int8 codes [T, K], fp32 scales [T, 1])."""
        x_TK = x_TK.contiguous()
        q = torch.empty(x_TK.shape, dtype=torch.int8)
        s = torch.empty((x_TK.shape[0], 1), dtype=torch.float32)
        _check(self.lib.qarl_quant_int8(x_TK.data_ptr(), _is_bf16(x_TK), x_TK.shape[0], x_TK.shape[1], q.data_ptr(),
                                        s.data_ptr()), x_TK.shape[0], 1)
        return q, s

    def plain(self, q_TK: Tensor, s_T1: Tensor, codes: list[Tensor], scales: list[Tensor]) -> Tensor:
        """The product of given codes by the kernel's plain C loop (fp32): the tests' reference for SIMD."""
        r, n = len(codes), codes[0].shape[0]
        out = torch.empty((r, n), dtype=torch.float32)
        w = (_P * r)(*[c.data_ptr() for c in codes])
        sw = (_P * r)(*[s.data_ptr() for s in scales])
        rc = self.lib.qarl_int8_gemv_plain(q_TK.contiguous().data_ptr(), s_T1.contiguous().data_ptr(),
                                           q_TK.shape[0], q_TK.shape[1], w, sw, r, n, out.data_ptr())
        _check(rc, q_TK.shape[0], r)
        return out


def _is_bf16(x: Tensor) -> int:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise ValueError(f"int8 GEMV: activation must be a 2-D fp32 or bf16 tensor, got {x.dtype} {list(x.shape)}")
    return int(x.dtype == torch.bfloat16)


def _check(rc: int, x_rows: int, r: int) -> None:
    if rc == -2:
        raise MemoryError("int8 GEMV: out of memory for the quantized activation")
    if rc:
        raise ValueError(f"int8 GEMV: {x_rows} activation rows for {r} linears (want 1 or {r})")


_LOADED: dict[str, Int8Gemv | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("QARL_KERNEL_CACHE", Path.home() / ".cache" / "megatron_qarl" / "kernels"))


def _cpu_id() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def build(out_dir: Path | None = None) -> Path:
    """Compile int8_gemv.c for this machine (or return the cached build). Raises RuntimeError on failure."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + cc.encode()).hexdigest()[:12]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"int8_gemv-{key}-{_cpu_id()}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [cc, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
               "-o", str(tmp_lib), str(SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-800:]}")
        os.replace(tmp_lib, lib)  # atomic: a concurrent build writes the same bytes
    return lib


def load() -> Int8Gemv | None:
    """The kernel, built on first use; None (reason logged once) where it cannot be had."""
    if "int8" in _LOADED:
        return _LOADED["int8"]
    kernel = None
    if os.environ.get("QARL_NATIVE_KERNELS", "1") == "0":
        log.info("native int8 kernel off (QARL_NATIVE_KERNELS=0): torch's int8 kernels")
    elif platform.system() != "Linux":
        log.info("native int8 kernel: built on Linux only; torch's int8 kernels")
    else:
        try:
            path = build()
            kernel = Int8Gemv(ctypes.CDLL(str(path)), path)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            log.warning("native int8 kernel unavailable, torch's int8 kernels instead: %s", err)
    _LOADED["int8"] = kernel
    return kernel
