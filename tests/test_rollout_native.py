"""The native low-bit kernels (serve/kernels/int8_gemv.c, int4_gemv.c, fp8_gemv.c via serve/kernels/native.py), every
instruction set this CPU runs (AVX-512, AVX2, plain C) against exact references:
- INT8: the learner's activation quantization bit for bit and the integer product exact;
- W4A16 and FP8: bit for bit the fp32 sums in the order their C files document (written here in torch, op
  by op), which makes every instruction set give the same bits, and within 1e-6 of float64;
- every row's result independent of how many rows the call has (batch invariance);
and the fallback when the kernels cannot be built."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_qarl.qat.quantizer import quant_act_fp8_per_token_group, quant_act_int8_per_token, quantize_fp8_block
from megatron_qarl.serve.kernels import native

KERNEL = native.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the engine runs torch's low-bit kernels")
ISAS = {fmt: KERNEL.isas(fmt) if KERNEL else [] for fmt in ("int8", "int4", "fp8")}
# shapes with tails: K not a multiple of the vector widths (int8), N odd, 1..8 linears, 1..5 activation rows
INT8_SHAPES = [(1, 2048, [1536] * 8), (8, 768, [2048] * 8), (3, 100, [37, 5]), (1, 70, [64, 64]), (5, 1, [1]),
               (4, 200, [200] * 4), (2, 33, [9] * 2), (5, 4097, [3])]


def _flags() -> str:
    return open("/proc/cpuinfo").read()


def test_kernel_builds_here():
    """On these machines (x86 with AVX2 and gcc) the fast paths are what run; cached by source hash."""
    assert KERNEL is not None
    assert KERNEL.path.exists() and native.build() == KERNEL.path
    flags = _flags()
    assert KERNEL.avx2 == all(f in flags for f in (" avx2", " fma", " f16c"))
    capped = os.environ.get("QARL_NATIVE_ISA") == "avx2"  # an AVX-512 machine choosing as an AVX2 one
    avx512 = KERNEL.avx2 and not capped and all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl",
                                                                            "avx512dq"))
    assert KERNEL.avx512 == avx512
    assert KERNEL.vnni == (avx512 and "avx512_vnni" in flags)
    assert KERNEL.int4_ok == (avx512 and "avx512_bf16" in flags)


@needs_kernel
def test_isa_cap(monkeypatch):
    """QARL_NATIVE_ISA=avx2 makes an AVX-512 machine choose what an AVX2-only one does; a typo is an error."""
    monkeypatch.setenv("QARL_NATIVE_ISA", "avx2")
    capped = native.Kernels(KERNEL.lib, KERNEL.path)
    assert not (capped.avx512 or capped.vnni or capped.int4_ok)
    assert all(capped.isas(f) == ["avx2", "plain"][1 - capped.avx2:] for f in ("int8", "int4", "fp8"))
    with pytest.raises(RuntimeError, match="does not run the avx512 kernel"):
        capped.int8(torch.randn(1, 32), [torch.zeros(4, 32, dtype=torch.int8)], [torch.ones(4)], torch.float32,
                    isa="avx512")
    monkeypatch.setenv("QARL_NATIVE_ISA", "avx-2")
    with pytest.raises(ValueError, match="QARL_NATIVE_ISA='avx-2'"):
        native.Kernels(KERNEL.lib, KERNEL.path)


# ------------------------------------------------------------------------------------------------ INT8
def _int8_operands(ns, k, seed):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g) for n in ns],
            [torch.rand(n, generator=g) * 1e-2 for n in ns])


def _int8_reference(q, s, codes, scales, diag):
    """The exact integer product (int64 matmul), scaled in the kernel's order: (acc * s_w) * s_x, in fp32."""
    if diag:
        return torch.cat([(q[r : r + 1].long() @ c.long().t()).float() * w * s[r]
                          for r, (c, w) in enumerate(zip(codes, scales, strict=True))])
    return torch.cat([(q.long() @ c.long().t()).float() * w * s for c, w in zip(codes, scales, strict=True)], 1)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-30, 30), bf16=st.booleans(),
       rows=st.integers(1, 5), k=st.integers(1, 300))
def test_int8_quantization_equals_the_learners(seed, log_scale, bf16, rows, k):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0**log_scale
    ties = torch.tensor([127.0, 63.5, -63.5, 0.5, -2.5, 0.49999997])[:k] * 2.0**log_scale
    x[0, : ties.numel()] = ties
    if rows > 1:
        x[1] = 0.0  # the 1e-10 floor
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    q_ref, s_ref = quant_act_int8_per_token(x)
    for isa in ("plain", "avx2"):  # the AVX2 loop where K is a multiple of 8, the plain one elsewhere
        q, s = KERNEL.int8_quant(x, isa)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), isa


@needs_kernel
@pytest.mark.parametrize(("t", "k", "ns"), INT8_SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int8_equals_the_exact_integer_product(t, k, ns, x_dtype):
    """fp32 out: bit-equal to the integer product scaled in the same order, for every instruction set, all rows
    through all linears and row r through linear r alone; bf16 out: the fp32 result rounded as torch rounds."""
    codes, scales = _int8_operands(ns, k, seed=len(ns) + k)
    x = (torch.randn(t, k, generator=torch.Generator().manual_seed(k)) * 3).to(x_dtype)
    q, s = quant_act_int8_per_token(x)
    for diag in (False, True) if t == len(ns) and len(set(ns)) == 1 else (False,):
        want = _int8_reference(q, s, codes, scales, diag)
        assert torch.equal(KERNEL.int8_plain(q, s, codes, scales, diag), want)
        for isa in ISAS["int8"]:
            y = KERNEL.int8(x, codes, scales, torch.float32, diag=diag, isa=isa)
            assert y.dtype == torch.float32 and torch.equal(y, want), (isa, diag)
            assert torch.equal(KERNEL.int8(x, codes, scales, torch.bfloat16, diag=diag, isa=isa), y.to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------- W4A16
def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c) with one rounding: a * b is exact in float64 here (a an fp32 sum, b a bf16 scale: 32
    significant bits), and so is the float64 sum while the operands are within 2^21 of each other in magnitude
    (they are, for these test operands), so the one rounding is the cast to fp32."""
    return (a.double() * b.double() + c.double()).float()


def _hsum16(v: torch.Tensor) -> torch.Tensor:
    """qarl_simd.h's hsum16 tree over the last dim (16 lanes), fp32."""
    h = v[..., 8:] + v[..., :8]
    q = h[..., 4:] + h[..., :4]
    return (q[..., 0] + q[..., 2]) + (q[..., 1] + q[..., 3])


def int4_reference(x_TK, u, scales, group):
    """int4_gemv.c's sums, op for op in torch fp32: per row, 16 lanes; lane i of chunk c (64 values) adds
    x * (u - 8) at k = 64c + 4i + e in the order e = 2, 0 (accumulator a0) and e = 3, 1 (a1); per group g,
    t_(g mod 2) = fma(a0 + a1, s[g], t_(g mod 2)); y = hsum16(t_0 + t_1). A bf16 x below 2^-126 counts as 0.
    Out [T, N]."""
    x = x_TK.float()
    x = torch.where(x.abs() < 2.0**-126, torch.zeros_like(x), x)
    t_, k = x.shape
    n = u.shape[0]
    w = u.float() - 8  # [N, K]
    xc = x.view(t_, 1, k // 64, 16, 4)  # [T, 1, chunk, lane, e]
    wc = w.view(1, n, k // 64, 16, 4)
    prod = xc * wc  # exact
    t = torch.zeros(2, t_, n, 16)
    for gi in range(k // group):
        a0 = torch.zeros(t_, n, 16)
        a1 = torch.zeros(t_, n, 16)
        for c in range(gi * group // 64, (gi + 1) * group // 64):
            a0 = a0 + prod[:, :, c, :, 2]
            a0 = a0 + prod[:, :, c, :, 0]
            a1 = a1 + prod[:, :, c, :, 3]
            a1 = a1 + prod[:, :, c, :, 1]
        t[gi % 2] = _fma32(a0 + a1, scales[:, gi].float().view(1, n, 1), t[gi % 2])
    return _hsum16(t[0] + t[1])


def _int4_operands(ns, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    u = [torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g) for n in ns]
    words = [(x[:, 0::2] | (x[:, 1::2] << 4)).contiguous() for x in u]  # the int32 words' bytes
    scales = [(torch.rand(n, k // group, generator=g) * 1e-2).to(torch.bfloat16) for n in ns]
    return u, words, scales


@needs_kernel
@pytest.mark.parametrize(("t", "k", "group", "ns"), [(1, 2048, 128, [1536] * 2), (8, 768, 128, [2048] * 8),
                                                     (1, 128, 64, [64, 64]), (3, 256, 256, [101] * 3),
                                                     (5, 384, 128, [33]), (2, 192, 64, [7, 7]),
                                                     (4, 128, 128, [1, 3, 5, 9]), (2, 2048, 2048, [40, 40])])
def test_int4_equals_its_documented_sums(t, k, group, ns):
    """Every instruction set: bit for bit the documented order (so the AVX2 kernel gives the AVX512-BF16 one's
    bits), within 1e-6 of the float64 product (relative to its largest entry); bf16 out: the fp32 one rounded.
    Activations span 2^-16..2^16, so that the fp32 sums round and their order shows (with x of one magnitude the
    few products a lane adds per group sum exactly, in any order)."""
    u, words, scales = _int4_operands(ns, k, group, seed=k + len(ns))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(t, k, generator=g) * 2.0 ** torch.randint(-16, 17, (t, k), generator=g)).to(torch.bfloat16)
    x[0, :3] = torch.tensor([1e-39, -3e-39, 0.0])  # bf16 denormals: 0, as vdpbf16ps reads them
    if t > 1:
        x[1] = torch.where(x[1] > 0, 1e-39, -2e-39).to(torch.bfloat16)  # a row of denormals: exactly 0 out
    for diag in (False, True) if t == len(ns) and len(set(ns)) == 1 else (False,):
        rows = [x[r : r + 1] if diag else x for r in range(len(ns))]
        parts = [int4_reference(xr, ur, sr, group) for xr, ur, sr in zip(rows, u, scales, strict=True)]
        want = torch.cat(parts) if diag else torch.cat(parts, 1)
        f64 = torch.cat([(xr.double() @ ((ur.double() - 8) * sr.double().repeat_interleave(group, 1)).T)
                         for xr, ur, sr in zip(rows, u, scales, strict=True)], 0 if diag else 1)
        if t > 1:
            f64[1] = 0.0  # what DAZ makes of the denormal row (token 1 in both layouts)
        assert float((want.double() - f64).abs().max() / f64.abs().max()) < 1e-5
        for isa in ISAS["int4"]:
            y = KERNEL.int4(x, words, scales, group, torch.float32, diag=diag, isa=isa)
            assert torch.equal(y, want), (isa, diag, float((y - want).abs().max()))
            assert torch.equal(KERNEL.int4(x, words, scales, group, torch.bfloat16, diag=diag, isa=isa),
                               y.to(torch.bfloat16))


@needs_kernel
def test_int4_refuses_shapes_it_does_not_take():
    _, words, scales = _int4_operands([16], 64, 32, seed=0)
    with pytest.raises(ValueError, match="unsupported shape"):
        KERNEL.int4(torch.randn(1, 64, dtype=torch.bfloat16), words, scales, 32, torch.float32)
    with pytest.raises(ValueError, match="2-D bf16"):
        KERNEL.int4(torch.randn(1, 64), words, scales, 64, torch.float32)


# ------------------------------------------------------------------------------------------------- FP8
def fp8_reference(x_TK, codes, scales_inv, block):
    """fp8_gemv.c's sums, op for op in torch fp32: the activation quantized by the learner's function; per
    row and block, 16 lanes, lane i of chunk c (16 values) adds qx * qw / 256 (exact) at k = 16c + i into
    accumulator c mod 2; dot = hsum16(acc_0 + acc_1); y = y + ((dot * 256) * sx[b]) * sw[n / B, b]. Out [T, N]."""
    qx, sx = quant_act_fp8_per_token_group(x_TK, block)
    t_, k = qx.shape
    n = codes.shape[0]
    prod = qx.float().view(t_, 1, k // 16, 16) * (codes.float() / 256).view(1, n, k // 16, 16)
    sw = scales_inv.repeat_interleave(block, 0)[:n]  # [N, K/B]
    y = torch.zeros(t_, n)
    for b in range(k // block):
        acc = torch.zeros(2, t_, n, 16)
        for c in range(block // 16):
            acc[c % 2] = acc[c % 2] + prod[:, :, b * block // 16 + c]
        dot = _hsum16(acc[0] + acc[1])
        y = y + ((dot * 256) * sx[:, b : b + 1]) * sw[:, b].view(1, n)
    return y


def _fp8_operands(ns, k, block, seed):
    g = torch.Generator().manual_seed(seed)
    qws = [quantize_fp8_block(torch.randn(n, k, generator=g) * 0.05, block) for n in ns]
    return [qw.codes for qw in qws], [qw.scales for qw in qws]


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-30, 30), bf16=st.booleans(),
       rows=st.integers(1, 4), groups=st.integers(1, 3), block=st.sampled_from([16, 32, 128]))
def test_fp8_quantization_equals_the_learners(seed, log_scale, bf16, rows, groups, block):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * block, generator=g) * 2.0**log_scale
    # e4m3 ties and limits, relative to the group max (448 after scaling): subnormal ties, the largest code
    x[0, :8] = torch.tensor([448.0, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-6 * 1.0625, 17.0, 18.0, -0.0, 1e-30])
    x[0, :8] *= x[0].abs().max() / 448.0
    if rows > 1:
        x[1] = 0.0  # the 1e-10 floor
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    q_ref, s_ref = quant_act_fp8_per_token_group(x, block)
    for isa in ("plain", "avx2"):
        q, s = KERNEL.fp8_quant(x, block, isa)
        assert torch.equal(q, q_ref.float()) and torch.equal(s, s_ref), isa
        assert torch.equal(q.view(torch.int32) >> 31, q_ref.float().view(torch.int32) >> 31)  # -0.0 stays -0.0


@needs_kernel
def test_quantizers_on_nan_and_inf():
    """A NaN or an infinity in a token or group: the fp8 codes and scales are the learner's (NaN stays NaN), and
    the int8 scale is too (its codes of a NaN are whatever a float -> int8 cast gives: 0 here)."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    x[0, 5], x[1, 130], x[2, 7], x[3, 200] = float("nan"), float("inf"), float("-inf"), float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        xx = x.to(dtype)
        q_ref, s_ref = quant_act_fp8_per_token_group(xx, 128)
        _, s8_ref = quant_act_int8_per_token(xx)
        for isa in ("plain", "avx2"):
            q, s = KERNEL.fp8_quant(xx, 128, isa)
            assert torch.equal(q.nan_to_num(7.0), q_ref.float().nan_to_num(7.0)), isa
            assert torch.equal(s.nan_to_num(7.0), s_ref.nan_to_num(7.0)), isa
            assert torch.equal(KERNEL.int8_quant(xx, isa)[1].nan_to_num(7.0), s8_ref.nan_to_num(7.0)), isa


@needs_kernel
@pytest.mark.parametrize(("t", "k", "block", "ns"), [(1, 2048, 128, [1536]), (8, 768, 128, [2048] * 8),
                                                     (3, 256, 128, [130, 7, 1]), (2, 96, 32, [33, 17]),
                                                     (5, 128, 128, [64]), (4, 48, 16, [5] * 4)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp8_equals_its_documented_sums(t, k, block, ns, x_dtype):
    """Every instruction set: bit for bit the documented order (SGLang's block-FP8 GEMM), within 1e-6 of the
    float64 product of the dequantized operands; bf16 out: the fp32 one rounded."""
    codes, scales = _fp8_operands(ns, k, block, seed=k + len(ns))
    x = (torch.randn(t, k, generator=torch.Generator().manual_seed(2)) * 3).to(x_dtype)
    qx, sx = quant_act_fp8_per_token_group(x, block)
    x_deq = qx.double() * sx.double().repeat_interleave(block, 1)
    for diag in (False, True) if t == len(ns) and len(set(ns)) == 1 else (False,):
        rows = [x[r : r + 1] if diag else x for r in range(len(ns))]
        want = torch.cat([fp8_reference(xr, c, s, block) for xr, c, s in zip(rows, codes, scales, strict=True)],
                         0 if diag else 1)
        f64 = torch.cat([(x_deq[r : r + 1] if diag else x_deq) @ (c.double() * s.double().repeat_interleave(
            block, 0).repeat_interleave(block, 1)[: c.shape[0]]).T for r, (c, s) in enumerate(zip(codes, scales,
                                                                                                  strict=True))],
                        0 if diag else 1)
        assert float((want.double() - f64).abs().max() / f64.abs().max()) < 1e-6
        for isa in ISAS["fp8"]:
            y = KERNEL.fp8(x, [c.view(torch.uint8) for c in codes], scales, block, torch.float32, diag=diag, isa=isa)
            assert torch.equal(y, want), (isa, diag, float((y - want).abs().max()))
            assert torch.equal(KERNEL.fp8(x, [c.view(torch.uint8) for c in codes], scales, block, torch.bfloat16,
                                          diag=diag, isa=isa), y.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------- all formats
def _calls(fmt):
    """(kernel call on activation rows x, K) per format, operands fixed."""
    if fmt == "int8":
        codes, scales = _int8_operands([300, 11], 264, seed=5)
        return (lambda x, isa: KERNEL.int8(x, codes, scales, torch.float32, isa=isa)), 264
    if fmt == "int4":
        _, words, scales = _int4_operands([300, 11], 256, 128, seed=5)
        return (lambda x, isa: KERNEL.int4(x, words, scales, 128, torch.float32, isa=isa)), 256
    codes, scales = _fp8_operands([300, 11], 256, 128, seed=5)
    codes = [c.view(torch.uint8) for c in codes]
    return (lambda x, isa: KERNEL.fp8(x, codes, scales, 128, torch.float32, isa=isa)), 256


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_a_rows_result_does_not_depend_on_the_batch(fmt):
    """Row t of a call with T rows equals the call with row t alone (any T; row r through linear r alone is
    checked against per-row references above), and the thread count changes nothing: each row's sums keep
    one order."""
    call, k = _calls(fmt)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # > one 64-row pass
    before = torch.get_num_threads()
    try:
        for isa in ISAS[fmt]:
            torch.set_num_threads(1)
            alone = torch.cat([call(x[t : t + 1], isa) for t in range(x.shape[0])])
            for rows in (2, 3, 5, 16, 70):
                assert torch.equal(call(x[:rows], isa), alone[:rows]), (isa, rows)
            torch.set_num_threads(2)
            assert torch.equal(call(x, isa), alone), isa
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_bad_operands_get_clear_errors():
    codes, scales = _int8_operands([16] * 3, 32, seed=0)
    with pytest.raises(ValueError, match="2 activation rows for 3 linears"):
        KERNEL.int8(torch.randn(2, 32), codes, scales, torch.float32, diag=True)
    with pytest.raises(ValueError, match="2-D fp32 or bf16"):
        KERNEL.int8(torch.randn(1, 32, dtype=torch.float16), codes, scales, torch.float32)
    fcodes, fscales = _fp8_operands([16], 96, 32, seed=0)
    with pytest.raises(ValueError, match="unsupported shape"):  # K not a multiple of the block
        KERNEL.fp8(torch.randn(1, 96), [c.view(torch.uint8) for c in fcodes], fscales, 64, torch.float32)


def test_no_compiler_falls_back_with_a_logged_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setenv("QARL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="megatron_qarl.serve.kernels.native"):
        assert native.load() is None
    assert "torch's low-bit kernels instead" in caplog.text and "/bin/false" in caplog.text
    assert not list(tmp_path.glob("*.so"))  # a failed build leaves nothing to load later
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setenv("QARL_NATIVE_KERNELS", "0")
    monkeypatch.delenv("CC")
    assert native.load() is None
