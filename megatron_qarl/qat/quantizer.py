"""The one quantizer: pure functions that turn a weight into integer codes + scales and back.

The learner's fake-quant forward (``fake_quant.py``) and the exporter (``export.py``) both call these
functions; nothing else in the project quantizes a weight. Shapes: a linear weight is ``w_NK``
(N = out features, K = in features, the reduction dim); activations are ``x_*K``.

Numerics rules that make the result identical on CPU and GPU:
- only max-reductions (order-independent), IEEE multiplications and tensor/tensor divisions;
  never ``python_scalar / tensor`` (torch computes that as ``reciprocal * scalar``) and never
  ``tensor / python_scalar`` (CUDA turns a CPU-scalar divisor into a reciprocal multiply);
- rounding is ``torch.round`` (half to even) unless a docstring says otherwise;
- fp32 -> float8_e4m3fn conversion rounds to nearest even; values are clamped to +-448 first.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_qarl.qat.config import QuantConfig, check_scheme

FP8_MAX = 448.0  # largest finite float8_e4m3fn
W4A16_BITS: tuple[int, ...] = (2, 3, 4)  # integer weight-only code widths; all stored in int4 containers
ACT_EPS = 1e-10  # SGLang's floor on a token (group) amax


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """Integer codes and scales of one linear weight ``w_NK``, exactly as exported to SGLang.

    codes:  w4a16 int8 [N, K] in [-8, 7] (num_bits b: [-2^(b-1), 2^(b-1) - 1]);  w8a8_fp8 float8_e4m3fn [N, K];
            w8a8_int8 int8 [N, K]
    scales: w4a16 bf16 [N, K/G] (weight_scale);  w8a8_fp8 fp32 [ceil(N/B), ceil(K/B)] (weight_scale_inv,
            a dequant multiplier);  w8a8_int8 fp32 [N, 1] (weight_scale)
    zero_points: w4a16 asymmetric only: int8 [N, K/G] in the codes' range; else None
    group_size: w4a16 group along K; w8a8_fp8 block edge B; None for w8a8_int8
    """

    codes: Tensor
    scales: Tensor
    zero_points: Tensor | None
    shape: tuple[int, int]
    scheme: str
    group_size: int | None = None

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight the rollout engine computes with (see ``dequantize_weight``)."""
        return dequantize_weight(self, dtype)


def _const(value: float, like: Tensor) -> Tensor:
    # A 1-element fp32 tensor on ``like``'s device: divisions by it are true IEEE divisions on CPU and GPU.
    return torch.full((1,), value, dtype=torch.float32, device=like.device)


def check_weight(w: Tensor, name: str = "weight", finite: bool = True) -> None:
    """Raise ValueError unless ``w`` is a 2-D floating-point tensor, finite unless ``finite`` is False (the
    caller checks that itself); messages name ``name``."""
    if w.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D weight [N, K], got shape {list(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {w.dtype}")
    if not finite:
        return
    # runs on every quantized weight every step: one reduction first (a nan/inf makes the sum non-finite;
    # a finite overflow of the sum is ruled out by the exact count)
    if not bool(torch.isfinite(w.float().sum())) and (bad := int((~torch.isfinite(w)).sum())):
        raise ValueError(f"{name}: {bad} non-finite value(s) (nan/inf) in weight of shape {list(w.shape)}")


# ----------------------------------------------------------------------------------------------- W4A16
def round_significant_bits(x: Tensor, bits: int) -> Tensor:
    """x rounded (half to even) to ``bits`` significant bits: m * 2^e with m in [0.5, 1) kept to 2^-bits."""
    m, e = torch.frexp(x.float())
    return torch.ldexp(torch.round(m * (1 << bits)) / (1 << bits), e)


def int_code_range(num_bits: int) -> tuple[int, int]:
    """(qmin, qmax) = (-2^(b-1), 2^(b-1) - 1) of ``num_bits``-bit signed integer codes (b in 2, 3, 4)."""
    if num_bits not in W4A16_BITS:
        raise ValueError(f"num_bits must be one of {W4A16_BITS} (codes stored as int4), got {num_bits}")
    return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1


def quantize_w4a16(
    w: Tensor, group_size: int = 128, symmetric: bool = True, name: str = "weight", scale_bits: int | None = None,
    num_bits: int = 4, check_finite: bool = True,
) -> QuantizedWeight:
    """INT4 per group of ``group_size`` along K, scale in bf16, for SGLang's Marlin (compressed-tensors).

    Symmetric (default), per group g of one row:
        s_b = bf16(amax_g / 7.5)              amax_g = max |w| over the group, in fp32; s_b = 1 if it is 0
        q   = clamp(round_half_even(w.float() / s_b.float()), -8, 7)
        w_fq = bf16(q * s_b)                  (= Marlin's bf16_round((u - 8) * scale_bf16), u = q + 8)
    ``scale_bits`` (symmetric only; QuantConfig's default is 5): the scale is first rounded to that many
    significant bits, s_b = bf16(round_significant_bits(amax_g / 7.5, scale_bits)). With 5 bits every
    q * s_b (|q| <= 8: 4 bits) is exact in bf16, so bf16(q * s_b) = q * s_b: Marlin, an fp32 CPU int4
    kernel and the learner compute with identical weights whatever their internal precision.
    Asymmetric (zero point z per group, both sides of 0 kept in range):
        lo = min(min_g, 0); hi = max(max_g, 0); s_b = bf16((hi - lo) / 15)
        z = clamp(round_half_even(-8 - lo / s_b), -8, 7); q = clamp(round_half_even(w / s_b) + z, -8, 7)
        w_fq = bf16((q - z) * s_b)            (compressed-tensors' dequantize, bit for bit)

    The scale is rounded to bf16 FIRST and the codes are computed against that rounded scale, so the
    exported (q, s_b) reproduce w_fq exactly; ``q * s_b`` is exact in fp32 (4 x 8 significant bits), so
    w_fq is a single rounding. Why amax/7.5 and not amax/7: it is compressed-tensors' RTN convention
    (scale = max(|min|, |max|) / 7.5, codes in [-8, 7]); it uses all 16 levels, its step is 6.7% finer
    than amax/7, and its worst-case error stays half a step (the +amax element lands on 7.5, is clamped
    to 7: error s/2), so the mean squared error is lower (measured in docs/quantization.md).

    ``num_bits`` 3 or 2 (a bit-width study): the same rules with b-bit codes, qmin = -2^(b-1),
    qmax = 2^(b-1) - 1 and the divisors 7.5 -> (2^b - 1) / 2 (3.5, 1.5) symmetric, 15 -> 2^b - 1 (7, 3)
    asymmetric; zero points in [qmin, qmax] too. The codes stay int8 in [-8, 7], so they are exported
    as int4 (weight_packed) with the same scales, and a 4-bit kernel (Marlin, torch's CPU int4 mm)
    computes exactly the b-bit weights. A code |q| <= 2^(b-1) has at most b - 1 significant bits, so the
    5-bit scale keeps every q * s_b exact in bf16 at every width (5 + 3 = 8 bits at b = 4).
    """
    return _w4a16(w, group_size, symmetric, name, scale_bits, num_bits, False, check_finite)[0]


def _w4a16_symmetric_core(w_ngg: Tensor, half_levels: Tensor, qmin: int, qmax: int,
                          scale_bits: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(codes int8, scale bf16, q * s fp32, amax) of symmetric W4A16 on groups ``w_ngg`` [N, K/G, G] (fp32).

    One read of the weight for amax (max |w|, nan/inf propagate into it), then q = clamp(round(w / s)) and
    q * s computed in place. Pure tensor code: it runs as is or compiled by torch.compile
    (``fake_quantize_weight(..., compiled=True)``)."""
    amax_ng = w_ngg.abs().amax(dim=-1)  # nan / inf propagate (torch max reductions keep nan)
    scale_ng = amax_ng / half_levels
    if scale_bits is not None:
        scale_ng = round_significant_bits(scale_ng, scale_bits)
    scale_ng = scale_ng.to(torch.bfloat16)
    scale_ng = torch.where(scale_ng == 0, torch.ones_like(scale_ng), scale_ng)
    s = scale_ng.float()[..., None]
    q = torch.div(w_ngg, s).round_().clamp_(qmin, qmax)
    return q.to(torch.int8), scale_ng, q.mul_(s), amax_ng


_COMPILED: dict[str, object] = {}


def _compiled_core():
    """``_w4a16_symmetric_core`` compiled once per process by torch.compile (inductor; shapes dynamic)."""
    if "w4a16" not in _COMPILED:
        _COMPILED["w4a16"] = torch.compile(_w4a16_symmetric_core, dynamic=True)
    return _COMPILED["w4a16"]


def _symmetric_core(compiled: bool, *args):
    """``_w4a16_symmetric_core(*args)``, compiled when asked and this torch can: a torch whose Dynamo cannot trace
    it (torch 2.11's: "call_function <built-in function lshift>(*(1, s12))", the code width as a symbolic int)
    runs it eager from then on, after one warning naming the key; the bits are the same either way."""
    if compiled and _COMPILED.get("w4a16") is not False:
        try:
            return _compiled_core()(*args)
        except Exception as err:  # noqa: BLE001 - any compile failure: the eager path computes the same bits
            _COMPILED["w4a16"] = False
            warnings.warn(f"learner.compile_quantizer: torch.compile of the W4A16 refresh failed on torch "
                          f"{torch.__version__} ({type(err).__name__}: {str(err).splitlines()[0][:200]}); it runs "
                          "eager (same bits). Set learner.compile_quantizer=false to silence this", stacklevel=2)
    return _w4a16_symmetric_core(*args)


def _w4a16(w: Tensor, group_size: int, symmetric: bool, name: str, scale_bits: int | None, num_bits: int,
           compiled: bool, check_finite: bool = True) -> tuple[QuantizedWeight, Tensor]:
    """(QuantizedWeight, w_fq fp32 [N, K] = its dequantized weight) of ``quantize_w4a16``'s rules."""
    check_weight(w, name, finite=check_finite and not symmetric)  # symmetric: amax (nan/inf propagate) checks
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{name}: group_size {group_size} does not divide K={k} (weight shape [{n}, {k}])")
    qmin, qmax = int_code_range(num_bits)
    levels = float(qmax - qmin)  # 15, 7, 3
    w_ngg = w.detach().float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
    if symmetric:
        codes, scale_ng, w_fq, amax_ng = _symmetric_core(compiled, w_ngg, _const(levels / 2, w), qmin, qmax,
                                                         scale_bits)
        if check_finite and not bool(torch.isfinite(amax_ng).all()):
            check_weight(w, name)  # raises, naming the count of non-finite values
        if scale_bits is None or scale_bits > 5:  # w_fq = bf16(q * s) as Marlin computes it; with a scale of
            w_fq = w_fq.to(torch.bfloat16).float()  # <= 5 significant bits q * s (|q| <= 8) is exact in bf16
            # (eager on purpose: inductor drops an fp32 -> bf16 -> fp32 round trip)
        qw = QuantizedWeight(codes.reshape(n, k), scale_ng, None, (n, k), "w4a16", group_size)
        return qw, w_fq.reshape(n, k)
    lo_ng = w_ngg.amin(dim=-1).clamp(max=0.0)
    hi_ng = w_ngg.amax(dim=-1).clamp(min=0.0)
    scale_ng = ((hi_ng - lo_ng) / _const(levels, w)).to(torch.bfloat16)
    scale_ng = torch.where(scale_ng == 0, torch.ones_like(scale_ng), scale_ng)
    zero_f = torch.round(_const(qmin, w) - lo_ng / scale_ng.float()).clamp_(qmin, qmax)
    q = (torch.round(w_ngg / scale_ng.float()[..., None]) + zero_f[..., None]).clamp_(qmin, qmax)
    qw = QuantizedWeight(q.to(torch.int8).reshape(n, k), scale_ng, zero_f.to(torch.int8), (n, k), "w4a16",
                         group_size)
    return qw, dequantize_w4a16(qw).float()


def dequantize_w4a16(qw: QuantizedWeight) -> Tensor:
    """w_NK = bf16((q - z) * s_b) per group (z = 0 when symmetric); returns bf16 [N, K]."""
    n, k = qw.shape
    g = qw.group_size
    q_ngg = qw.codes.float().reshape(n, k // g, g)
    if qw.zero_points is not None:
        q_ngg = q_ngg - qw.zero_points.float()[..., None]
    return (q_ngg * qw.scales.float()[..., None]).to(torch.bfloat16).reshape(n, k)


# -------------------------------------------------------------------------------------- W8A8 FP8 weights
def _pad_to_blocks(w: Tensor, block: int) -> Tensor:
    n, k = w.shape
    pn, pk = -n % block, -k % block
    return torch.nn.functional.pad(w, (0, pk, 0, pn)) if pn or pk else w


def quantize_fp8_block(w: Tensor, block_size: int = 128, name: str = "weight",
                       check_finite: bool = True) -> QuantizedWeight:
    """float8 e4m3 weights in ``block_size`` x ``block_size`` blocks (DeepSeek-V3 / Qwen3-FP8 layout).

    Per block b (partial blocks at the edges allowed):
        s_b = amax_b / 448   (fp32; 1 if amax_b = 0)     exported as weight_scale_inv [ceil(N/B), ceil(K/B)]
        q   = e4m3_round_half_even(clamp(w.float() / s_b, -448, 448))
        w_fq = q.float() * s_b                               (fp32; cast to the module dtype by the caller)
    """
    check_weight(w, name, finite=check_finite)
    n, k = w.shape
    b = block_size
    w_p = _pad_to_blocks(w.detach().float(), b)
    nb, kb = w_p.shape[0] // b, w_p.shape[1] // b
    w_bbbb = w_p.reshape(nb, b, kb, b)  # [N/B, B, K/B, B]
    amax = w_bbbb.abs().amax(dim=(1, 3))  # [N/B, K/B]
    scale = amax / _const(FP8_MAX, w)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (w_bbbb / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = q.reshape(nb * b, kb * b)[:n, :k].contiguous()
    return QuantizedWeight(codes, scale, None, (n, k), "w8a8_fp8", block_size)


def dequantize_fp8_block(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_NK = q.float() * weight_scale_inv[block of (n, k)], computed in fp32, returned in ``dtype``."""
    n, k = qw.shape
    b = qw.group_size
    scale_nk = qw.scales.repeat_interleave(b, dim=0).repeat_interleave(b, dim=1)[:n, :k]
    return (qw.codes.float() * scale_nk).to(dtype)


# ------------------------------------------------------------------------------------- W8A8 INT8 weights
def quantize_int8_channel(w: Tensor, name: str = "weight", check_finite: bool = True) -> QuantizedWeight:
    """int8 per output channel, symmetric, static (SGLang ``w8a8_int8``). Per row n:

    s_n = amax_n / 127   (fp32 [N, 1]; 1 if amax_n = 0)     exported as weight_scale
    q   = clamp(round_half_even(w.float() / s_n), -128, 127)
    w_fq = q.float() * s_n                                   (fp32; cast to the module dtype)
    """
    check_weight(w, name, finite=check_finite)
    n, k = w.shape
    w_nk = w.detach().float()
    scale_n1 = w_nk.abs().amax(dim=-1, keepdim=True) / _const(127.0, w)
    scale_n1 = torch.where(scale_n1 == 0, torch.ones_like(scale_n1), scale_n1)
    codes = torch.round(w_nk / scale_n1).clamp_(-128, 127).to(torch.int8)
    return QuantizedWeight(codes, scale_n1, None, (n, k), "w8a8_int8", None)


def dequantize_int8_channel(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_NK = q.float() * weight_scale[n], computed in fp32, returned in ``dtype``."""
    return (qw.codes.float() * qw.scales).to(dtype)


# ------------------------------------------------------------------------------------------- dispatchers
def quantize_weight(w: Tensor, cfg: QuantConfig, name: str = "weight", check_finite: bool = True) -> QuantizedWeight:
    """Quantize ``w`` with the scheme of ``cfg`` (the single entry point of the learner and the exporter).
    ``check_finite`` False: no ValueError for a nan / inf in ``w`` (that check reads a device value on the host);
    its scales are then non-finite (every scheme's scale is a max of |w| over its group, which propagates them),
    which the caller checks where it may sync (``scales_finite``)."""
    scheme = check_scheme(cfg.scheme)
    if scheme == "w4a16":
        return quantize_w4a16(w, cfg.group_size, cfg.symmetric, name, cfg.scale_bits if cfg.symmetric else None,
                              cfg.num_bits, check_finite)
    if scheme == "w8a8_fp8":
        return quantize_fp8_block(w, cfg.group_size, name, check_finite)
    if scheme == "w8a8_int8":
        return quantize_int8_channel(w, name, check_finite)
    raise ValueError(f"{name}: scheme bf16 means quantization is off; nothing to quantize")


def fake_quantize_weight(w: Tensor, cfg: QuantConfig, name: str = "weight", compiled: bool = False,
                         check_finite: bool = True) -> tuple[QuantizedWeight, Tensor]:
    """(qw, w_fq): ``quantize_weight(w, cfg)`` and its ``dequantize_weight(qw, w.dtype)``, bit for bit, in one
    pass set (the learner's per-step refresh). ``compiled``: the W4A16 symmetric math runs compiled by
    torch.compile (one fused kernel; same bits, tested), after a one-off compile in each process.
    ``check_finite``: as ``quantize_weight``; without it a nan / inf in ``w`` makes w_fq non-finite too."""
    scheme = check_scheme(cfg.scheme)
    if scheme == "w4a16":
        qw, w_fq = _w4a16(w, cfg.group_size, cfg.symmetric, name, cfg.scale_bits if cfg.symmetric else None,
                          cfg.num_bits, compiled, check_finite)
        return qw, w_fq.to(w.dtype)
    qw = quantize_weight(w, cfg, name, check_finite)
    return qw, dequantize_weight(qw, w.dtype)


def scales_finite(qw: QuantizedWeight) -> Tensor:
    """A 0-dim bool tensor on qw's device: every scale finite, i.e. the weight was (each scale is a max of |w|
    over its group, times a finite constant, so a nan / inf anywhere in the weight reaches one). No host sync."""
    return torch.isfinite(qw.scales).all()


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype | None = None) -> Tensor:
    """Dequantize by scheme. ``dtype=None``: bf16 for w4a16 (the Marlin value), fp32 for w8a8."""
    scheme = check_scheme(qw.scheme)
    if scheme == "w4a16":
        w = dequantize_w4a16(qw)
        return w if dtype is None else w.to(dtype)  # bf16 -> fp32 is exact
    if scheme == "w8a8_fp8":
        return dequantize_fp8_block(qw, dtype or torch.float32)
    if scheme == "w8a8_int8":
        return dequantize_int8_channel(qw, dtype or torch.float32)
    raise ValueError("scheme bf16 has no quantized weights")


# ------------------------------------------------------------------------------------------- activations
def quant_act_fp8_per_token_group(x: Tensor, group_size: int = 128) -> tuple[Tensor, Tensor]:
    """Per token, per group of ``group_size`` along K, dynamic fp8 e4m3: SGLang's sgl-kernel recipe.

    Follows ``sgl_per_token_group_quant_8bit`` (the CUDA op behind ``sglang_per_token_group_quant_fp8``):
        a = max(amax_group, 1e-10)               fp32
        q = e4m3_rne(clamp(x.float() * (448 / a), -448, 448))     multiply by the inverse scale
        s = a * fp32(1 / 448)                    the stored scale (dequant multiplier)
    Returns (codes float8_e4m3fn [..., K], scales fp32 [..., K/group]). The Triton fallback computes
    s = a / 448 and multiplies by 1 / s: it can differ from this by one ulp in s.
    """
    codes_tgg, scale = _fp8_act_groups(x.detach(), group_size)
    return codes_tgg.reshape(x.shape), scale.squeeze(-1)


def _fp8_act_groups(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(codes float8_e4m3fn [..., K/G, G], scales fp32 [..., K/G, 1]) of ``quant_act_fp8_per_token_group``."""
    *lead, k = x.shape
    if k % group_size:
        raise ValueError(f"activation: group_size {group_size} does not divide K={k}")
    x_tgg = x.float().reshape(*lead, k // group_size, group_size)
    amax = x_tgg.abs().amax(dim=-1, keepdim=True).clamp_(min=ACT_EPS)  # [..., K/G, 1]
    codes = (x_tgg * (torch.full_like(amax, FP8_MAX) / amax)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, amax * _const(1.0 / FP8_MAX, x)  # fp32(1/448) * a, as in the kernel


def dequant_act_fp8_per_token_group(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """x_fq = (q.float() * s_group) in fp32, returned in ``dtype``."""
    *lead, k = codes.shape
    g = k // scales.shape[-1]
    x = codes.float().reshape(*lead, k // g, g) * scales[..., None]
    return x.reshape(*lead, k).to(dtype)


def quant_act_int8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, dynamic, symmetric int8: SGLang's ``per_token_quant_int8`` (used by ``w8a8_int8``).

        a = max(amax_token, 1e-10)               fp32
        t = x.float() * (127 / a)                fp32
        q = clamp(round_half_away(t), -128, 127)
        s = a / 127                              fp32 [..., 1]
    Returns (codes int8 [..., K], scales fp32 [..., 1]).

    Computed in few ops (the rollout engine runs this once per linear at every decode step, where each
    small op costs microseconds): amax in x's dtype (a max is exact in any dtype), ``x * mult`` with
    type promotion (= x.float() * mult), and ``round_half_away(t) = trunc(2t) - trunc(t)`` (2t is exact;
    with t = n + f, trunc(2t) = 2n + trunc(2f), and trunc(2f) = sign(t) iff |f| >= 1/2). The clamp is a
    no-op for finite x: |t| <= fl(127 / a) * a * (1 + 2^-24) < 127.5, so it is left out.
    tests/test_qat_quantizer.py checks codes and scales against the plain formula, ties included.
    """
    q, amax = _int8_act_values(x.detach())
    return q.to(torch.int8), amax / _const(127.0, x)


def _int8_act_values(x: Tensor) -> tuple[Tensor, Tensor]:
    """(q fp32 [..., K]: the codes' values, a [..., 1]: the floored amax) of ``quant_act_int8_per_token``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=ACT_EPS)
    t = torch.mul(x, torch.full_like(amax, 127.0).div_(amax))
    return torch.trunc(t * 2).sub_(torch.trunc(t)), amax


def dequant_act_int8_per_token(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """x_fq = (q.float() * s_token) in fp32, returned in ``dtype``."""
    return (codes.float() * scales).to(dtype)


def fake_quant_act_int8_per_token(x: Tensor) -> Tensor:
    """``dequant_act_int8_per_token(*quant_act_int8_per_token(x), x.dtype)`` without the int8 codes (the learner's
    W8A8 forward, every linear's input): q = trunc(2t) - trunc(t) is an integer in [-127, 127] held exactly in fp32,
    so x_fq = (q * s).to(x.dtype) is the same value, bit for bit, for finite x (a non-finite row gives nan here,
    code 0 there). 15 aten ops: amax (abs, amax, fp32, floor), 127 / a, x * it, the rounding (x2, two truncs, a
    subtraction), s = a / 127, q * s, the cast back; each is needed by the formula."""
    q, amax = _int8_act_values(x)
    return (q * (amax / _const(127.0, x))).to(x.dtype)


def fake_quant_act_fp8_per_token_group(x: Tensor, group_size: int = 128) -> Tensor:
    """``dequant_act_fp8_per_token_group(*quant_act_fp8_per_token_group(x, g), x.dtype)`` on the grouped codes
    (no reshape of them to [..., K] and back): the same operations on the same values (the e4m3 round trip is the
    rounding), bit for bit."""
    codes_tgg, scale = _fp8_act_groups(x, group_size)
    return (codes_tgg.float() * scale).reshape(x.shape).to(x.dtype)
