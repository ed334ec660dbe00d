"""The learner's Triton refresh kernels (qat/triton_refresh.py, issue 37) against the one quantizer, run by Triton's
interpreter on CPU tensors: codes, scales, zero points and the dequantized weight, bit for bit, for every scheme and
W4A16 variant, from both master dtypes, on weights built to hit each rounding's edge (ties, the e4m3 subnormals and
its largest value, subnormal and zero scales, partial FP8 blocks, two passes over K); a nan / inf gives non-finite
scales where the torch path's are. Then through the learner's FakeQuant with ``learner.refresh_kernel=triton``: the
same forward weights and sync codes as ``torch``. On a lent GPU the same kernels run compiled (scripts/gpu_smoke.sh)."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit runs: the kernels are then interpreted (CPU tensors)

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.quantizer import fake_quantize_weight, scales_finite

triton_refresh = pytest.importorskip("megatron_qarl.qat.triton_refresh")
if not triton_refresh.INTERPRETED:  # imported earlier in this process without the interpreter
    triton_refresh = importlib.reload(triton_refresh)

VARIANTS = {
    "w4a16": dict(scheme="w4a16"),
    "w4a16 g64": dict(scheme="w4a16", group_size=64),
    "w4a16 asymmetric": dict(scheme="w4a16", symmetric=False),
    "w4a16 scale_bits=None": dict(scheme="w4a16", scale_bits=None),
    "w4a16 scale_bits=3": dict(scheme="w4a16", scale_bits=3),
    "w4a16 3-bit": dict(scheme="w4a16", num_bits=3),
    "w4a16 2-bit asymmetric": dict(scheme="w4a16", num_bits=2, symmetric=False),
    "w8a8_fp8": dict(scheme="w8a8_fp8"),
    "w8a8_fp8 b64": dict(scheme="w8a8_fp8", group_size=64),
    "w8a8_int8": dict(scheme="w8a8_int8"),
}


def _differ(w: torch.Tensor, cfg: QuantConfig) -> list[str]:
    """Fields whose dtype or bits differ between the torch reference and the Triton kernel."""
    from megatron_qarl.gpu.smoke import refresh_differences

    return refresh_differences(fake_quantize_weight(w, cfg, check_finite=False),
                               triton_refresh.fake_quantize_triton(w, cfg))


def _edgy_weight(n: int, k: int, cfg: QuantConfig, dtype: torch.dtype) -> torch.Tensor:
    """Normal weights with rows that hit each rounding's edges."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0] = 0.0  # all-zero groups: scale 1
    w[1, :64] = -0.0
    w[2] *= 1e-37  # subnormal scales (W4A16: amax / 7.5 < 2^-126) and fp8 subnormal codes
    w[3] = torch.arange(k) % 17 - 8.0  # integer steps: exact ties of w / s at half codes
    w[4] = (torch.arange(k) % 9) * 0.5 - 2.0
    w[5, 1::2] = 448.0 * 2.0 ** -torch.arange(0, k // 2).remainder(30).float()  # e4m3 binades, largest value
    w[6, :] = 1e30  # large
    w[7] = torch.linspace(-1, 1, k)
    if cfg.scheme == "w8a8_fp8":  # values between e4m3 neighbours, ties included, in one block with its amax
        w[8] = 448.0 * (torch.arange(k) % 64 + 0.5) / 64
    return w.to(dtype)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_refresh_is_the_reference_quantizer_bit_for_bit(variant, dtype):
    cfg = QuantConfig(**VARIANTS[variant])
    k = 256 if cfg.scheme == "w4a16" else 1100  # FP8: partial blocks along K and N; INT8: two passes over K
    n = 136 if cfg.scheme == "w8a8_fp8" else 40
    w = _edgy_weight(n, k, cfg, dtype)
    assert _differ(w, cfg) == []


@settings(max_examples=30, deadline=None)
@given(variant=st.sampled_from(list(VARIANTS)), exponent=st.integers(-140, 60), seed=st.integers(0, 2 ** 16),
       bf16=st.booleans())
def test_the_triton_refresh_agrees_at_every_magnitude(variant, exponent, seed, bf16):
    """Random weights scaled by 2^exponent: the scales cross subnormal, normal and huge binades."""
    cfg = QuantConfig(**VARIANTS[variant])
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(seed)) * 2.0 ** exponent
    assert _differ(w.to(torch.bfloat16) if bf16 else w, cfg) == []


@pytest.mark.parametrize("variant", ["w4a16", "w4a16 asymmetric", "w8a8_fp8", "w8a8_int8"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_weight_gives_nonfinite_scales_as_on_the_torch_path(variant, bad):
    cfg = QuantConfig(**VARIANTS[variant])
    w = torch.randn(128, 256) * 0.02
    w[70, 200] = bad
    qw, fq = triton_refresh.fake_quantize_triton(w, cfg)
    ref, _ = fake_quantize_weight(w, cfg, check_finite=False)
    assert not bool(scales_finite(qw)) and not bool(scales_finite(ref))
    assert torch.equal(torch.isfinite(qw.scales), torch.isfinite(ref.scales))
    assert not bool(torch.isfinite(fq[70]).all())
    clean = w.clone()
    clean[70, 200] = 0.0
    assert bool(scales_finite(triton_refresh.fake_quantize_triton(clean, cfg)[0]))


def _fake_quant_paths(scheme: str) -> dict:
    """The same model's FakeQuant with refresh_kernel triton and torch: forward weights and sync codes."""
    from megatron_qarl.moe.model import forward_logits
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.qat.modules import apply_fake_quant
    from tests.test_learner_launches import arch_with, random_model

    init_parallel()
    arch = arch_with(8)
    model = random_model(arch, 5)
    cfg = QuantConfig(scheme=scheme)
    tokens = torch.randint(0, arch.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    out = {}
    for kernel in ("triton", "torch"):
        fq = apply_fake_quant(model, arch, cfg, refresh_kernel=kernel)
        with torch.no_grad():
            logits = forward_logits(model, tokens)
        out[kernel] = {"kernel": fq.kernel, "logits": logits,
                       "weights": [t.local_fq.clone() for t in fq.targets],
                       "codes": [{n: (q.codes, q.scales) for n, q in fq.target_codes(t).items()} for t in fq.targets]}
        fq.remove()
    return out


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8_fp8", "w8a8_int8"])
def test_the_learner_refreshes_with_the_triton_kernel_to_the_same_bits(scheme):
    from megatron_qarl.gpu.smoke import same_bits
    from megatron_qarl.moe.parallelize import run_ranks

    r = run_ranks(1, _fake_quant_paths, scheme)[0]
    assert r["triton"]["kernel"] == "triton" and r["torch"]["kernel"] == "torch"
    assert torch.equal(r["triton"]["logits"], r["torch"]["logits"])
    assert all(torch.equal(a, b) for a, b in zip(r["triton"]["weights"], r["torch"]["weights"], strict=True))
    for a, b in zip(r["triton"]["codes"], r["torch"]["codes"], strict=True):
        assert a.keys() == b.keys()
        assert all(same_bits(a[n][0], b[n][0]) and same_bits(a[n][1], b[n][1]) for n in a)


def test_refresh_kernel_resolution_and_refusals(monkeypatch):
    from megatron_qarl.config import LearnerConfig
    from megatron_qarl.qat.modules import resolve_refresh_kernel

    cpu = torch.device("cpu")
    assert resolve_refresh_kernel("auto", cpu) == "torch"
    assert resolve_refresh_kernel("torch", cpu) == "torch"
    assert resolve_refresh_kernel("triton", cpu) == "triton"  # the interpreter is on (this module)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^learner\.refresh_kernel: triton on a CPU learner"):
        resolve_refresh_kernel("triton", cpu)
    if torch.version.cuda is None:  # the simulated device reports cuda on a CPU build: the torch ops run there
        assert resolve_refresh_kernel("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="refresh_kernel: triton and learner.compile_quantizer"):
        LearnerConfig(refresh_kernel="triton", compile_quantizer=True)
    assert LearnerConfig(refresh_kernel="auto", compile_quantizer=True).refresh_kernel == "auto"


def test_the_kernels_compile_for_a_hopper_gpu_without_approximate_division_or_fma():
    """Triton's own compiler, here without a GPU: every variant the learner launches compiles for compute capability
    9.0 (H100 / H200) to a cubin (ptxas from the Triton wheel), and what it made of the roundings is the exact
    operations the interpreter ran: IEEE division (div.rn.f32, no div.full / div.approx), no FMA contraction (the
    kernels are launched with fp fusion off), no flush of subnormals to zero (no .ftz: subnormal scales and e4m3
    codes stay exact), the round-to-integer constants +-1.5 * 2^23 (and +-1.5 * 2^14 for the
    e4m3 subnormals) added and subtracted. This caught a kernel the interpreter ran and the compiler refused (two
    return statements of different types in a constexpr branch). And the NaN checks survive (issue 48): Triton
    builds with LLVM's NoNaNsFPMath, under which ``x != x`` could fold to false; only InstCombine turning it into an
    unordered compare keeps it, which PTX writes ``setp.nan``. Every variant carries NaN (``_max_nan``,
    ``_bf16_bits``), so every variant's PTX must hold one: a Triton that drops them fails here, not on a GPU
    (where a nan weight would then get a finite scale and garbage codes)."""
    script = ("import json; from megatron_qarl.qat.triton_refresh import compile_variants; "
              "print(json.dumps(compile_variants(90)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [name for name, _ in variants].count("_w4a16_kernel") == 4 and len(variants) == 8
    for name, ptx in variants:
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx, name
        assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx, name  # no FMA, subnormals kept (no ftz)
        assert "setp.nan.f32" in ptx, name  # the nan checks were compiled, not folded away
        if name == "_fp8_block_kernel":
            assert "0f46C00000" in ptx and "0fC6C00000" in ptx, name  # +-24576
        else:
            assert "0f4B400000" in ptx and "0fCB400000" in ptx, name  # +-12582912


def test_a_cpu_run_with_the_triton_refresh_is_refused_at_load_and_a_gpu_config_takes_it():
    from megatron_qarl.errors import ConfigError
    from megatron_qarl.preflight.rules import load_config

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with pytest.raises(ConfigError, match=r"^learner\.refresh_kernel: triton runs on the learner's GPUs"):
        load_config(os.path.join(repo, "configs", "cpu_default.yaml"), ["learner.refresh_kernel=triton"])
    cfg = load_config(os.path.join(repo, "configs", "qwen3-30b-a3b", "w4a16_tbpo_2x8.yaml"),
                      ["learner.refresh_kernel=triton", "rollout.api_key=test"])
    assert cfg.learner.refresh_kernel == "triton"
