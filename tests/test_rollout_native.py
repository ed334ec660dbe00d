"""The native one-token kernels (rollout/int8_gemv.c, int4_gemv.c via rollout/native.py): INT8 with the
learner's activation quantization bit for bit and the integer product exact; W4A16 against a float64
reference; the fallback when they cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_qarl.qat.quantizer import quant_act_int8_per_token
from megatron_qarl.rollout import native

KERNEL = native.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the engine runs torch's low-bit kernels")
needs_int4 = pytest.mark.skipif(KERNEL is None or not KERNEL.int4_ok, reason="no AVX512-BF16: torch's int4 kernel runs")


def _codes(n, k, count, seed):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g) for _ in range(count)],
            [torch.rand(n, generator=g) * 1e-2 for _ in range(count)])


def _reference(q, s, codes, scales):
    """The exact integer product (int64 matmul), scaled in the kernel's order: (acc * s_w) * s_x, in fp32."""
    rows = [q[0 if q.shape[0] == 1 else r :][:1] for r in range(len(codes))]
    xs = [s[0 if s.shape[0] == 1 else r] for r in range(len(codes))]
    return torch.cat([(x.long() @ c.long().t()).float() * w * sx for x, c, w, sx in zip(rows, codes, scales, xs,
                                                                                       strict=True)])


def test_kernel_builds_here():
    """On these machines (x86 with AVX512-VNNI and gcc) the fast path is what runs; cached by source hash."""
    assert KERNEL is not None
    assert KERNEL.path.exists() and native.build() == KERNEL.path
    flags = open("/proc/cpuinfo").read()
    assert KERNEL.vnni == ("avx512_vnni" in flags and "avx512bw" in flags)
    assert KERNEL.int4_ok == ("avx512_bf16" in flags and "avx512bw" in flags)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-30, 30), bf16=st.booleans(),
       rows=st.integers(1, 5), k=st.integers(1, 300))
def test_quantization_equals_the_learners(seed, log_scale, bf16, rows, k):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0**log_scale
    ties = torch.tensor([127.0, 63.5, -63.5, 0.5, -2.5, 0.49999997])[:k] * 2.0**log_scale
    x[0, : ties.numel()] = ties
    if rows > 1:
        x[1] = 0.0  # the 1e-10 floor
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    q, s = KERNEL.int8_quant(x)
    q_ref, s_ref = quant_act_int8_per_token(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@needs_kernel
@pytest.mark.parametrize(("n", "k", "r", "x_rows"), [(1536, 2048, 8, 1), (2048, 768, 8, 8), (37, 100, 3, 3),
                                                     (64, 70, 2, 1), (5, 1, 1, 1), (200, 64, 4, 4)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_the_exact_integer_product(n, k, r, x_rows, x_dtype):
    """fp32 out: bit-equal to the integer product scaled in the same order, and to the kernel's plain C loop;
    bf16 out: the fp32 result rounded as torch rounds. K and N not multiples of the SIMD widths included."""
    codes, scales = _codes(n, k, r, seed=n + k)
    x = (torch.randn(x_rows, k, generator=torch.Generator().manual_seed(k)) * 3).to(x_dtype)
    q, s = quant_act_int8_per_token(x)
    y = KERNEL.int8(x, codes, scales, torch.float32)
    assert y.shape == (r, n) and y.dtype == torch.float32
    assert torch.equal(y, _reference(q, s, codes, scales))
    assert torch.equal(KERNEL.int8_plain(q, s, codes, scales), y)
    assert torch.equal(KERNEL.int8(x, codes, scales, torch.bfloat16), y.to(torch.bfloat16))


@needs_kernel
def test_gemv_threads_do_not_change_the_result():
    codes, scales = _codes(1000, 512, 4, seed=3)
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.int8(x, codes, scales, torch.float32)
        torch.set_num_threads(2)
        assert torch.equal(KERNEL.int8(x, codes, scales, torch.float32), one)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_bad_operands_get_clear_errors():
    codes, scales = _codes(16, 32, 3, seed=0)
    with pytest.raises(ValueError, match="2 activation rows for 3 linears"):
        KERNEL.int8(torch.randn(2, 32), codes, scales, torch.float32)
    with pytest.raises(ValueError, match="2-D fp32 or bf16"):
        KERNEL.int8(torch.randn(1, 32, dtype=torch.float16), codes, scales, torch.float32)


def _int4_operands(n, k, group, count, seed):
    g = torch.Generator().manual_seed(seed)
    u = [torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g) for _ in range(count)]
    words = [(x[:, 0::2] | (x[:, 1::2] << 4)).contiguous() for x in u]  # the int32 words' bytes
    scales = [(torch.rand(n, k // group, generator=g) * 1e-2).to(torch.bfloat16) for _ in range(count)]
    return u, words, scales


@needs_int4
@pytest.mark.parametrize(("n", "k", "group", "r", "x_rows"), [(1536, 2048, 128, 16, 1), (2048, 768, 128, 8, 8),
                                                              (64, 128, 64, 2, 1), (100, 256, 256, 3, 3)])
def test_int4_gemv_equals_float64_reference(n, k, group, r, x_rows):
    """y = sum_g s[n, g] sum_k x[k] (u - 8): fp32 accumulation within 1e-6 of the float64 result (relative to
    its largest entry); the bf16 output is the fp32 one rounded as torch rounds."""
    u, words, scales = _int4_operands(n, k, group, r, seed=n + k)
    x = torch.randn(x_rows, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = KERNEL.int4(x, words, scales, group, torch.float32)
    ref = torch.stack([x[0 if x_rows == 1 else i].double()
                       @ ((u[i].double() - 8) * scales[i].double().repeat_interleave(group, 1)).T for i in range(r)])
    assert y.shape == (r, n) and float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    assert torch.equal(KERNEL.int4(x, words, scales, group, torch.bfloat16), y.to(torch.bfloat16))


@needs_int4
def test_int4_gemv_refuses_shapes_it_does_not_take():
    _, words, scales = _int4_operands(16, 64, 32, 1, seed=0)
    with pytest.raises(ValueError, match="unsupported shape .*group 32"):
        KERNEL.int4(torch.randn(1, 64, dtype=torch.bfloat16), words, scales, 32, torch.float32)
    with pytest.raises(ValueError, match="2-D bf16"):
        KERNEL.int4(torch.randn(1, 64), words, scales, 64, torch.float32)


def test_no_compiler_falls_back_with_a_logged_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setenv("QARL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="megatron_qarl.rollout.native"):
        assert native.load() is None
    assert "torch's low-bit kernels instead" in caplog.text and "/bin/false" in caplog.text
    assert not list(tmp_path.glob("*.so"))  # a failed build leaves nothing to load later
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setenv("QARL_NATIVE_KERNELS", "0")
    monkeypatch.delenv("CC")
    assert native.load() is None
