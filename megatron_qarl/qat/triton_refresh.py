"""The learner's per-step refresh on CUDA: one Triton kernel per scheme, bit for bit the one quantizer.

``fake_quantize_triton(w, cfg)`` returns what ``quantizer.fake_quantize_weight(w, cfg, check_finite=False)`` returns
(codes, scales, zero points, and the dequantized weight in ``w``'s dtype), the same bits for a finite weight, from one
kernel launch that reads the weight once and writes each output once (FP8: twice, a pass for the block's amax; the
torch path runs ~15 kernels and re-reads the weight in each). The formulas are those of ``qat/quantizer.py``; this
module only re-expresses their roundings in operations that are exact and identical on a GPU and in Triton's
interpreter:

- divisions are ``tl.math.div_rn`` (IEEE round to nearest; Triton's ``/`` may be approximate on a GPU);
- round half to even of |x| <= 2^22 is ``(|x| + 1.5 * 2^23) - 1.5 * 2^23`` (fp32 adds round to nearest even) with
  x's sign put back (torch.round(-0.3) is -0.0), after the clamp to the integer code range (clamp and rounding
  commute for integer bounds);
- fp32 -> bf16 (round to nearest even) and the W4A16 scale's ``round_significant_bits`` round the fp32 bit pattern
  as an integer: add half an ulp of the kept part minus one plus its last bit, clear the dropped bits (a carry into
  the exponent is the correct next binade); for a subnormal scale the kept bits count from its leading one, as
  ``torch.frexp`` does;
- fp32 -> float8_e4m3fn (round to nearest even, after the clamp to +-448): the same integer rounding to 3 mantissa
  bits from 2^-6 up, and ``(x + 1.5 * 2^14) - 1.5 * 2^14`` (a multiple of 2^-9) below;
- a max reduction carries nan explicitly (a GPU max may drop it): a nan / inf weight gives a non-finite scale, as on
  the torch path, which ``quantizer.scales_finite`` reads without a host sync (its codes and dequantized values are
  then not the torch path's bits: nan payloads and clamps of nan differ between devices; they are never sent);
- bf16 tensors are read and written as their 16-bit patterns (exact widening, and the interpreter has no bf16).

Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported) runs the same kernels on CPU tensors:
tests/test_triton_refresh.py checks them against the reference quantizer there; a lent GPU runs them compiled
(scripts/gpu_smoke.sh). The learner uses this path where ``learner.refresh_kernel`` resolves to ``triton`` (``auto``:
CUDA weights and Triton importable, ``qat.modules.refresh_kernel``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_qarl.qat.config import QuantConfig, check_scheme
from megatron_qarl.qat.quantizer import QuantizedWeight, check_weight, int_code_range


@triton.jit
def _load_f32(ptr, offs, mask, IN_BF16: tl.constexpr):
    if IN_BF16:  # the 16-bit pattern is the top half of the fp32 one
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16
        w = bits.to(tl.float32, bitcast=True)
    else:  # one return: the compiler types every return statement, a constexpr branch's too
        w = tl.load(ptr + offs, mask=mask, other=0.0)
    return w


@triton.jit
def _bf16_bits(x):
    """The bf16 pattern (in the low 16 bits of a uint32) nearest to fp32 ``x``, ties to even; nan stays nan."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, (u >> 16) | 0x40, r)


@triton.jit
def _bf16_round(x):
    """fp32(bf16(x)): x rounded to 8 significant bits, ties to even."""
    return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _store_out(ptr, offs, x, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        tl.store(ptr + offs, _bf16_bits(x).to(tl.uint16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _rint(x):
    """Round half to even, the sign kept (-0.3 -> -0.0, as torch.round); exact for |x| <= 2^22 (callers clamp)."""
    r = (tl.abs(x) + 12582912.0) - 12582912.0
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _max_nan(x, axis: tl.constexpr):
    """max over ``axis`` that is nan when any element is (fp32)."""
    has_nan = tl.max((x != x).to(tl.int32), axis=axis)
    return tl.where(has_nan > 0, float("nan"), tl.max(x, axis=axis))


@triton.jit
def _maximum_nan(a, b):
    """Elementwise max that is nan where either is (a running amax over chunks)."""
    return tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))


@triton.jit
def _min_nan(x, axis: tl.constexpr):
    has_nan = tl.max((x != x).to(tl.int32), axis=axis)
    return tl.where(has_nan > 0, float("nan"), tl.min(x, axis=axis))


@triton.jit
def _round_significant(x, BITS: tl.constexpr):
    """``quantizer.round_significant_bits(x, BITS)`` for x >= 0 (a scale): ties to even, on the bit pattern."""
    u = x.to(tl.uint32, bitcast=True)
    lead = ((u.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127  # subnormal: its top bit
    sig = tl.where(u < 0x00800000, lead + 1, 24)
    drop = tl.maximum(sig - BITS, 0).to(tl.uint32)
    half = (tl.full(u.shape, 1, tl.uint32) << tl.maximum(drop, 1)) >> 1
    rounded = ((u + half - 1 + ((u >> drop) & 1)) >> drop) << drop
    return tl.where((drop > 0) & (x == x), rounded, u).to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_kernel(w_ptr, codes_ptr, scales_ptr, zeros_ptr, fq_ptr, n_groups,
                  G: tl.constexpr, BLOCK: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                  SYMMETRIC: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, DIVISOR: tl.constexpr,
                  SCALE_BITS: tl.constexpr, FQ_BF16: tl.constexpr):
    """BLOCK groups of G weights per program (a row of [N * K / G, G]); see ``quantizer.quantize_w4a16``."""
    groups = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = groups < n_groups
    offs = groups[:, None] * G + tl.arange(0, G)[None, :]
    mask = in_range[:, None]
    w = _load_f32(w_ptr, offs, mask, IN_BF16)
    divisor = tl.full((BLOCK,), DIVISOR, tl.float32)
    if SYMMETRIC:
        scale = tl.math.div_rn(_max_nan(tl.abs(w), 1), divisor)
        if SCALE_BITS > 0:
            scale = _round_significant(scale, SCALE_BITS)
    else:
        lo = _min_nan(w, 1)
        hi = _max_nan(w, 1)
        lo = tl.where(lo != lo, lo, tl.minimum(lo, 0.0))  # a nan stays (a minimum with 0 may drop it)
        hi = tl.where(hi != hi, hi, tl.maximum(hi, 0.0))
        scale = tl.math.div_rn(hi - lo, divisor)
    scale = _bf16_round(scale)
    scale = tl.where(scale == 0.0, 1.0, scale)
    tl.store(scales_ptr + groups, _bf16_bits(scale).to(tl.uint16), mask=in_range)
    x = tl.math.div_rn(w, scale[:, None])
    if SYMMETRIC:
        q = _rint(tl.minimum(tl.maximum(x, QMIN), QMAX))
        fq = q * scale[:, None]
    else:
        zero = _rint(tl.minimum(tl.maximum(QMIN - tl.math.div_rn(lo, scale), QMIN), QMAX))
        tl.store(zeros_ptr + groups, zero.to(tl.int8), mask=in_range)
        q = tl.minimum(tl.maximum(_rint(tl.minimum(tl.maximum(x, -4194304.0), 4194304.0)) + zero[:, None], QMIN),
                       QMAX)
        fq = (q - zero[:, None]) * scale[:, None]
    if FQ_BF16:
        fq = _bf16_round(fq)
    tl.store(codes_ptr + offs, q.to(tl.int8), mask=mask)
    _store_out(fq_ptr, offs, fq, mask, OUT_BF16)


@triton.jit
def _e4m3(x):
    """(fp32 value, uint32 code) of float8_e4m3fn(x), ties to even, for |x| <= 448 or nan (sign kept, -0 too)."""
    a = tl.abs(x)
    u = a.to(tl.uint32, bitcast=True)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) << 20
    sub = ((a + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    r = tl.where(a >= 0.015625, normal, sub)  # 2^-6: the smallest normal e4m3
    rf = r.to(tl.float32, bitcast=True)
    code = tl.where(rf >= 0.015625, (((r >> 23) - 120) << 3) | ((r >> 20) & 7), (rf * 512.0).to(tl.uint32))
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    code = tl.where(x != x, 0x7F, code) | (sign >> 24)
    return (r | sign).to(tl.float32, bitcast=True), code


@triton.jit
def _fp8_block_kernel(w_ptr, codes_ptr, scales_ptr, fq_ptr, n, k, kb,
                      B: tl.constexpr, ROWS: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    """One B x B block per program, in chunks of ROWS rows (a whole block's tile spills registers): a pass for its
    amax, a pass for the codes; see ``quantizer.quantize_fp8_block``."""
    bn, bk = tl.program_id(0), tl.program_id(1)
    cols = bk.to(tl.int64) * B + tl.arange(0, B)
    amax = tl.zeros((B,), tl.float32)
    for r in range(0, B, ROWS):
        rows = bn.to(tl.int64) * B + r + tl.arange(0, ROWS)
        mask = (rows < n)[:, None] & (cols < k)[None, :]
        w = _load_f32(w_ptr, rows[:, None] * k + cols[None, :], mask, IN_BF16)
        chunk = _max_nan(tl.abs(w), 0)
        amax = _maximum_nan(amax, chunk)
    scale = tl.math.div_rn(_max_nan(amax, 0), 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    tl.store(scales_ptr + bn * kb + bk, scale)
    for r in range(0, B, ROWS):
        rows = bn.to(tl.int64) * B + r + tl.arange(0, ROWS)
        mask = (rows < n)[:, None] & (cols < k)[None, :]
        offs = rows[:, None] * k + cols[None, :]
        w = _load_f32(w_ptr, offs, mask, IN_BF16)
        x = tl.math.div_rn(w, tl.full((ROWS, B), 1.0, tl.float32) * scale)
        value, code = _e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
        _store_out(fq_ptr, offs, value * scale, mask, OUT_BF16)


@triton.jit
def _int8_channel_kernel(w_ptr, codes_ptr, scales_ptr, fq_ptr, n, k,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    """BLOCK_R rows per program, two passes over K (amax, then codes); see ``quantizer.quantize_int8_channel``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n
    amax = tl.zeros((BLOCK_R,), tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask = in_range[:, None] & (cols < k)[None, :]
        w = _load_f32(w_ptr, rows[:, None] * k + cols[None, :], mask, IN_BF16)
        block_max = _max_nan(tl.abs(w), 1)
        amax = _maximum_nan(amax, block_max)
    scale = tl.math.div_rn(amax, tl.full((BLOCK_R,), 127.0, tl.float32))
    scale = tl.where(scale == 0.0, 1.0, scale)
    tl.store(scales_ptr + rows, scale, mask=in_range)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask = in_range[:, None] & (cols < k)[None, :]
        offs = rows[:, None] * k + cols[None, :]
        w = _load_f32(w_ptr, offs, mask, IN_BF16)
        codes = _rint(tl.minimum(tl.maximum(tl.math.div_rn(w, scale[:, None]), -128.0), 127.0)).to(tl.int8)
        tl.store(codes_ptr + offs, codes, mask=mask)
        _store_out(fq_ptr, offs, codes.to(tl.float32) * scale[:, None], mask, OUT_BF16)  # the int codes: +0, not -0


# triton.jit read TRITON_INTERPRET when the kernels above were defined: interpreted kernels run on CPU tensors
INTERPRETED = type(_w4a16_kernel).__name__ == "InterpretedFunction"
# no FMA contraction (Triton 3.9 contracts by default): every multiply and add rounds as the reference's
_OPTIONS = {} if INTERPRETED else {"enable_fp_fusion": False}


def _operand(w: Tensor) -> tuple[Tensor, bool]:
    """(the tensor the kernel reads, whether it holds bf16 patterns): fp32 as is, bf16 as int16, others as fp32."""
    w = w.detach().contiguous()
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16), True
    return (w if w.dtype == torch.float32 else w.float()), False


def _output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, bool]:
    """(the dequantized weight, the tensor the kernel writes, whether it writes bf16 patterns)."""
    if dtype == torch.bfloat16:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return out, out.view(torch.uint16), True
    out = torch.empty(shape, dtype=torch.float32, device=device)
    return out, out, False


def _check_device(w: Tensor, name: str) -> None:
    if w.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(f"{name}: learner.refresh_kernel=triton on a CPU tensor needs Triton's interpreter "
                           "(TRITON_INTERPRET=1 in the environment before megatron_qarl.qat.triton_refresh is "
                           "imported); the CPU's own path is refresh_kernel=torch")


def fake_quantize_triton(w: Tensor, cfg: QuantConfig, name: str = "weight") -> tuple[QuantizedWeight, Tensor]:
    """(qw, w_fq) of ``quantizer.fake_quantize_weight(w, cfg, name, check_finite=False)``, bit for bit for a finite
    ``w``, in one kernel launch on ``w``'s device. No host sync: a nan / inf in ``w`` makes its scales non-finite, as
    on the torch path (``quantizer.scales_finite``; its codes and dequantized values are then not the torch path's
    bits, and never sent: ``FakeQuant.target_codes`` refuses such a weight)."""
    scheme = check_scheme(cfg.scheme)
    check_weight(w, name, finite=False)
    _check_device(w, name)
    with torch.cuda.device(w.device) if w.device.type == "cuda" else contextlib.nullcontext():
        return _launch(w, cfg, scheme, name)


def _launch(w: Tensor, cfg: QuantConfig, scheme: str, name: str) -> tuple[QuantizedWeight, Tensor]:
    n, k = w.shape
    src, in_bf16 = _operand(w)
    fq, out, out_bf16 = _output((n, k), w.dtype if w.dtype == torch.bfloat16 else torch.float32, w.device)
    if scheme == "w4a16":
        g = cfg.group_size
        if g <= 0 or k % g or g & (g - 1):
            raise ValueError(f"{name}: group_size {g} does not divide K={k} (weight shape [{n}, {k}]) or is not a "
                             "power of two (the Triton refresh's tile)")
        qmin, qmax = int_code_range(cfg.num_bits)
        scale_bits = cfg.scale_bits if cfg.symmetric else None
        codes = torch.empty((n, k), dtype=torch.int8, device=w.device)
        scales = torch.empty((n, k // g), dtype=torch.bfloat16, device=w.device)
        zeros = None if cfg.symmetric else torch.empty((n, k // g), dtype=torch.int8, device=w.device)
        n_groups, block = n * k // g, max(1, 4096 // g)
        _w4a16_kernel[(triton.cdiv(n_groups, block),)](
            src, codes, scales.view(torch.uint16), codes if zeros is None else zeros, out, n_groups,
            G=g, BLOCK=block, IN_BF16=in_bf16, OUT_BF16=out_bf16, SYMMETRIC=cfg.symmetric, QMIN=float(qmin),
            QMAX=float(qmax), DIVISOR=float(qmax - qmin) / (2.0 if cfg.symmetric else 1.0),
            SCALE_BITS=scale_bits or 0, FQ_BF16=not cfg.symmetric or scale_bits is None or scale_bits > 5,
            **_OPTIONS)
        qw = QuantizedWeight(codes, scales, zeros, (n, k), "w4a16", g)
    elif scheme == "w8a8_fp8":
        b = cfg.group_size
        if b & (b - 1):
            raise ValueError(f"{name}: FP8 block {b} is not a power of two (the Triton refresh's tile)")
        nb, kb = triton.cdiv(n, b), triton.cdiv(k, b)
        codes = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
        _fp8_block_kernel[(nb, kb)](src, codes.view(torch.uint8), scales, out, n, k, kb, B=b, ROWS=min(b, 16),
                                    IN_BF16=in_bf16, OUT_BF16=out_bf16, **_OPTIONS)
        qw = QuantizedWeight(codes, scales, None, (n, k), "w8a8_fp8", b)
    else:
        codes = torch.empty((n, k), dtype=torch.int8, device=w.device)
        scales = torch.empty((n, 1), dtype=torch.float32, device=w.device)
        block_k = min(triton.next_power_of_2(k), 1024)
        _int8_channel_kernel[(triton.cdiv(n, 4),)](src, codes, scales, out, n, k, BLOCK_R=4, BLOCK_K=block_k,
                                                   IN_BF16=in_bf16, OUT_BF16=out_bf16, **_OPTIONS)
        qw = QuantizedWeight(codes, scales, None, (n, k), "w8a8_int8", None)
    return qw, (fq if fq.dtype == w.dtype else fq.to(w.dtype))


def _signatures() -> list[tuple[object, dict[str, str], dict[str, object]]]:
    """(kernel, argument types, constexprs) of the kernel variants ``fake_quantize_triton`` launches: each kernel
    from fp32 and from bf16 masters, and W4A16's asymmetric and unrounded-scale variants."""
    out = []
    for bf16 in (False, True):
        w, fq = ("*i16", "*u16") if bf16 else ("*fp32", "*fp32")
        w4 = {"w_ptr": w, "codes_ptr": "*i8", "scales_ptr": "*u16", "zeros_ptr": "*i8", "fq_ptr": fq, "n_groups": "i32"}
        out.append((_w4a16_kernel, w4, dict(G=128, BLOCK=32, IN_BF16=bf16, OUT_BF16=bf16, SYMMETRIC=True, QMIN=-8.0,
                                            QMAX=7.0, DIVISOR=7.5, SCALE_BITS=5, FQ_BF16=False)))
        out.append((_fp8_block_kernel, {"w_ptr": w, "codes_ptr": "*u8", "scales_ptr": "*fp32", "fq_ptr": fq, "n": "i32",
                                        "k": "i32", "kb": "i32"}, dict(B=128, ROWS=16, IN_BF16=bf16, OUT_BF16=bf16)))
        out.append((_int8_channel_kernel, {"w_ptr": w, "codes_ptr": "*i8", "scales_ptr": "*fp32", "fq_ptr": fq,
                                           "n": "i32", "k": "i32"}, dict(BLOCK_R=4, BLOCK_K=1024, IN_BF16=bf16,
                                                                         OUT_BF16=bf16)))
    out.append((_w4a16_kernel, w4, dict(G=128, BLOCK=32, IN_BF16=True, OUT_BF16=True, SYMMETRIC=False, QMIN=-8.0,
                                        QMAX=7.0, DIVISOR=15.0, SCALE_BITS=0, FQ_BF16=True)))
    out.append((_w4a16_kernel, w4, dict(G=128, BLOCK=32, IN_BF16=True, OUT_BF16=True, SYMMETRIC=True, QMIN=-8.0,
                                        QMAX=7.0, DIVISOR=7.5, SCALE_BITS=0, FQ_BF16=True)))
    return out


def compile_variants(capability: int = 90) -> list[tuple[str, str]]:
    """(kernel name, PTX) of every variant in ``_signatures``, compiled by Triton for CUDA compute capability
    ``capability`` (90: H100 / H200) down to a cubin by the ptxas Triton ships: no GPU needed, so a CPU checks that
    the kernels compile and what the compiler made of their roundings (tests/test_triton_refresh.py). FP fusion off,
    as they are launched (``enable_fp_fusion=False``: no multiply-add is contracted into an FMA)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        raise RuntimeError("compile_variants: the kernels were defined under TRITON_INTERPRET=1 (interpreted)")
    out = []
    for kernel, signature, constexprs in _signatures():
        src = ASTSource(fn=kernel, signature={**signature, **{c: "constexpr" for c in constexprs}},
                        constexprs={(kernel.arg_names.index(c),): v for c, v in constexprs.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"enable_fp_fusion": False})
        out.append((kernel.fn.__name__, compiled.asm["ptx"]))
    return out
