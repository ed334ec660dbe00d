"""Linear layers of the embedded engine: one class per checkpoint format, each on its CPU kernel.

Shapes: a weight is ``[N, K]`` (N = out features, K = reduction dim); activations ``x_TK`` (T tokens).
Every layer may fuse several HF linears that share their input (q/k/v, or an expert's gate/up) into
one GEMM along N: one kernel call instead of three matters at decode, where a call costs ~10-20 us.

The engine keeps a *store*: HF name -> tensor in the server's checkpoint format (what SGLang would
hold and what ``/weights_checker`` hashes). Each layer registers its tensors there and, where it can,
computes from views of the very same memory, so a weight update is an in-place ``copy_`` into the
store followed by ``refresh()`` of the layers whose derived operands are not views:

    DenseLinear  w [N, K] in the compute dtype; the store entries are row views of the fused weight.
                 In bf16 the GEMM runs on a oneDNN-prepacked copy of it (see ``PackedDense``).
    Int4Linear   W4A16 (compressed-tensors pack-quantized): the store holds weight_packed / weight_scale /
                 weight_shape as loaded. bf16 mode: the native kernel (``native.py``, int4_gemv.c) reads the
                 int32 words' bytes in place for 1 row (AVX512-BF16) or up to 2 (AVX2); torch's kernel
                 (``_weight_int4pack_mm_for_cpu`` on its own uint8 [N, K/2] layout with qScaleAndZeros
                 [K/G, N, 2]: w = (u - 8) * scale) for more rows and where the native one does not apply (fp32
                 mode, zero points, other group sizes). No bf16/fp32 copy of the weight exists at any time.
    Int8Linear   W8A8-INT8: codes int8 [N, K] (store views), per-channel scales; activations quantized per
                 token with the learner's formula (``quant_act_int8_per_token``, or the native kernel's
                 copy of it, bit for bit); the exact integer GEMM runs on the native kernel over the codes in
                 place (one row on AVX512-VNNI machines; every row count on AVX2 ones), or on oneDNN's u8s8
                 kernel over a prepacked copy (several rows where it is exact: VNNI; fallback: ``_weight_int8pack_mm``).
    Fp8Linear    W8A8-FP8: the store holds the e4m3 codes and weight_scale_inv; the native kernel
                 (fp8_gemv.c) reads the codes in place and computes SGLang's block-FP8 GEMM, activations
                 quantized per token group with the learner's formula. Without it (no compiler, no AVX2):
                 the per-block dequantization of the codes in the compute dtype on oneDNN / ``F.linear``,
                 activations quantized and dequantized with the learner's function.

Which kernel a layer runs is chosen per machine at load (the instruction sets the CPU has: ``native.py``);
``make_linear`` logs it (INFO once per choice, DEBUG per layer) and ``speed_check`` measures it against BF16.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import MutableMapping

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_qarl.qat.pack import unpack_int4
from megatron_qarl.qat.quantizer import (
    QuantizedWeight,
    dequant_act_fp8_per_token_group,
    dequant_act_int8_per_token,
    dequantize_fp8_block,
    quant_act_fp8_per_token_group,
    quant_act_int8_per_token,
)
from megatron_qarl.serve.kernels import native, speed_check

log = logging.getLogger(__name__)
Store = MutableMapping[str, Tensor]
INT4_INNER_K_TILES = 2  # torch's CPU int4 packing ignores the tiling beyond validating it


def detect_format(prefix: str, raw: Store) -> str:
    """The checkpoint format of linear ``prefix``: dense, w4a16, w8a8_int8 or w8a8_fp8 (from its tensors)."""
    if f"{prefix}.weight_packed" in raw:
        return "w4a16"
    w = raw.get(f"{prefix}.weight")
    if w is None:
        raise KeyError(f"{prefix}: no .weight nor .weight_packed tensor in the checkpoint")
    if w.dtype == torch.float8_e4m3fn:
        return "w8a8_fp8"
    if w.dtype == torch.int8:
        return "w8a8_int8"
    return "dense"


def _take(raw: Store, name: str) -> Tensor:
    if name not in raw:
        raise KeyError(f"{name}: missing from the checkpoint")
    return raw.pop(name)


class Linear:
    """Base: ``names`` are the store entries this layer reads; ``splits`` the N of each fused linear;
    ``kernel``: what runs it on this machine for one activation row and for several, and why (logged)."""

    names: list[str]
    splits: list[int]
    kernel: dict[str, str]

    def __call__(self, x_TK: Tensor) -> Tensor:
        return self.mm(self.prepare(x_TK))

    def prepare(self, x_TK: Tensor) -> Tensor:
        """The activation the GEMM consumes (W8A8: quantized per token, dequantized). Row-wise, so the
        rows of one prepared batch may be fed to several layers of the same format (the MoE does)."""
        return x_TK

    def mm(self, x_TK: Tensor) -> Tensor:
        raise NotImplementedError

    def refresh(self) -> None:
        """Recompute operands that are not views of the store (after an in-place weight update)."""

    def split(self, y_TN: Tensor) -> tuple[Tensor, ...]:
        return tuple(torch.split(y_TN, self.splits, dim=-1))

    @classmethod
    def rows_mm(cls, linears: list[Linear], x) -> Tensor:
        """[len(linears), N]: row i of the prepared activation ``x`` through ``linears[i]`` (a one-row ``x``:
        that row through every linear). The batch-1 MoE: the token through its top-k experts' gate_up,
        then row i of their activations through expert i's down. Subclasses batch the work around the
        kernel calls."""
        rows = [x] * len(linears) if x.shape[0] == 1 else [x[i : i + 1] for i in range(x.shape[0])]
        return torch.cat([lin.mm(r) for lin, r in zip(linears, rows, strict=True)])


def _fuse_rows(prefixes: list[str], suffix: str, parts: list[Tensor], store: Store) -> Tensor:
    """Concatenate ``parts`` along dim 0 and put row views of the result into ``store``.

    Always a fresh allocation: tensors read from safetensors may sit at any byte offset, and torch's
    int8 CPU kernel crashes on an operand that is not aligned the way its allocator aligns.
    """
    fused = torch.cat(parts) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)
    row = 0
    for p, t in zip(prefixes, parts, strict=True):
        store[f"{p}.{suffix}"] = fused[row : row + t.shape[0]]
        row += t.shape[0]
    return fused


def _mkldnn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedDense:
    """``x @ w.T`` for a dense weight in the compute dtype, on the fastest CPU path with the same result.

    ``F.linear`` in bf16 calls oneDNN, which reorders the plain [N, K] weight into its blocked layout on
    *every* call: at decode (a few rows of activations) that reorder is most of the work, and bf16 GEMVs
    reach about 18 GB/s instead of the ~45 GB/s the machine can stream (benchmarks/decode.py measures
    both). Reordering once at load (``mkldnn._reorder_linear_weight``, the op Inductor's CPU freezing pass
    uses) and calling ``mkldnn._linear_pointwise`` gives bit-identical outputs (the same oneDNN kernel)
    at 2-2.5x the speed. The packed copy is an opaque oneDNN tensor: the plain weight stays in the store
    (checksums, in-place updates), so dense bf16 weights are held twice; ``refresh()`` re-packs.
    fp32 (the exactness mode) keeps ``F.linear`` (MKL), which is what transformers runs. ``keep_plain=False``
    (a weight derived for this GEMM alone, as FP8's dequantization): once packed, the plain copy is dropped.
    """

    def __init__(self, w_NK: Tensor, keep_plain: bool = True):
        self.w_NK: Tensor | None = w_NK
        self.dtype = w_NK.dtype
        self.use_packed = w_NK.dtype == torch.bfloat16 and _mkldnn_bf16()
        self.refresh()
        if self.packed is not None and not keep_plain:
            self.w_NK = None

    def refresh(self) -> None:
        self.packed = None
        if self.use_packed:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w_NK, None)
            except RuntimeError as err:  # oneDNN capped below its bf16 ISA (ONEDNN_MAX_CPU_ISA): F.linear
                log.warning("bf16 GEMMs on F.linear: oneDNN cannot prepack here (%s)", str(err).splitlines()[0])
                self.use_packed = False

    @property
    def name(self) -> str:
        return "bf16 oneDNN prepacked" if self.packed is not None else f"{_dtype_name(self.dtype)} F.linear"

    def __call__(self, x_TK: Tensor) -> Tensor:
        if self.packed is None or x_TK.dtype != torch.bfloat16 or x_TK.dim() != 2:
            return F.linear(x_TK, self.w_NK)
        return torch.ops.mkldnn._linear_pointwise(x_TK.contiguous(), self.packed, None, "none", [], "")


class DenseLinear(Linear):
    def __init__(self, prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype):
        parts = [_take(raw, f"{p}.weight").to(dtype) for p in prefixes]
        self.splits = [t.shape[0] for t in parts]
        self.w_NK = _fuse_rows(prefixes, "weight", parts, store)
        self.names = [f"{p}.weight" for p in prefixes]
        self.gemm = PackedDense(self.w_NK)
        self.kernel = {"1 row": self.gemm.name, "rows": self.gemm.name, "why": "dense weights"}

    def refresh(self) -> None:
        self.gemm.refresh()

    def mm(self, x_TK: Tensor) -> Tensor:
        return self.gemm(x_TK)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RowsAct:
    """An activation a native kernel quantizes itself (the W8A8 formats): ``x_TK`` as given. Taking rows
    (``x[rows]``, ``x[a:b]``, as the batched MoE does per expert) takes them from ``x_TK``."""

    def __init__(self, x_TK: Tensor):
        self.x_TK = x_TK

    @property
    def shape(self) -> torch.Size:
        return self.x_TK.shape

    def __getitem__(self, rows) -> RowsAct:
        return type(self)(self.x_TK[rows])


class QuantAct(RowsAct):
    """A W8A8-INT8 activation, quantized per token when first needed (``quant_act_int8_per_token``):
    int8 codes ``q_TK``, fp32 scales ``s_T1``, and the codes shifted to uint8, ``u8_TK = q + 128``, which
    oneDNN's u8s8 GEMM takes with zero point 128 (so it computes with q exactly). The native kernel
    takes ``x_TK`` and quantizes it itself, the same way. With ``share`` (oneDNN will run the rows), taking
    rows quantizes all rows first, once, and the parts share the codes."""

    def __init__(self, x_TK: Tensor, share: bool = True):
        super().__init__(x_TK)
        self.share = share
        self._q: tuple[Tensor, Tensor, Tensor] | None = None

    def _quantized(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._q is None:
            q_TK, s_T1 = _quant_act_int8(self.x_TK)
            self._q = q_TK, s_T1, torch.bitwise_xor(q_TK.view(torch.uint8), 128)  # = q + 128 as uint8
        return self._q

    q_TK = property(lambda self: self._quantized()[0])
    s_T1 = property(lambda self: self._quantized()[1])
    u8_TK = property(lambda self: self._quantized()[2])

    def __getitem__(self, rows) -> QuantAct:
        part = QuantAct(self.x_TK[rows], self.share)
        if self.share:
            part._q = tuple(t[rows] for t in self._quantized())  # type: ignore[assignment]
        return part


def _quant_act_int8(x_TK: Tensor) -> tuple[Tensor, Tensor]:
    """``quant_act_int8_per_token`` of a 2-D activation; by the native kernels' AVX2 quantizer where it runs
    (the same codes and scales, tested; one call instead of ~25 us of small torch ops at decode)."""
    lib = native.load()
    if lib is not None and lib.avx2 and x_TK.dim() == 2 and x_TK.dtype in (torch.float32, torch.bfloat16):
        return lib.int8_quant(x_TK, "avx2")
    return quant_act_int8_per_token(x_TK)


def _fake_quant_act_fp8(x_TK: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """The FP8 activation as the dequantized path takes it: quantized per token group of ``block`` with the
    learner's formula and dequantized in fp32 to ``dtype`` (the native quantizer where it runs: same codes)."""
    lib = native.load()
    if (lib is not None and lib.avx2 and x_TK.dim() == 2 and x_TK.dtype in (torch.float32, torch.bfloat16)
            and x_TK.shape[1] % block == 0):
        q_TK, s_TG = lib.fp8_quant(x_TK, block, "avx2")  # the codes' values, fp32
        return (q_TK.view(x_TK.shape[0], -1, block) * s_TG[..., None]).view(x_TK.shape).to(dtype)
    return dequant_act_fp8_per_token_group(*quant_act_fp8_per_token_group(x_TK, block), dtype)


def _onednn_int8() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def _onednn_int8_exact() -> bool:
    """Whether oneDNN's u8s8 GEMM computes the exact integer product in this process: with VNNI it accumulates in
    int32; without it (a CPU without VNNI, or oneDNN capped below it by DNNL_MAX_CPU_ISA / ONEDNN_MAX_CPU_ISA, e.g.
    AVX2 on an AVX512-VNNI CPU) it adds pairs of u8 x s8 products in saturating int16. Checked once, on operands
    whose pairs saturate (255 x 127 x 2 > 32767)."""
    if not _onednn_int8():
        return False
    w = torch.full((16, 64), 127, dtype=torch.int8)
    u8 = torch.full((2, 64), 255, dtype=torch.uint8)  # q = 127 at zero point 128
    y = torch.ops.onednn.qlinear_pointwise(u8, 1.0, 128, torch.ops.onednn.qlinear_prepack(w, None), torch.ones(16),
                                           torch.zeros(16, dtype=torch.int64), None, 1.0, 0, torch.float32, "none",
                                           [], "")
    return bool((y == 127 * 127 * 64).all())


def _native_for(fmt: str, dtype: torch.dtype) -> tuple[native.Kernels | None, str]:
    """The native kernels and the best instruction set this CPU runs for ``fmt``, or (None, why not)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return None, f"compute dtype {_dtype_name(dtype)}"
    lib = native.load()
    if lib is None:
        return None, "native kernels unavailable (see the log of megatron_qarl.serve.kernels.native)"
    isa = lib.isas(fmt)[0]
    if isa == "plain":
        return None, "no AVX2 (the plain C loop is slower than torch's kernel)"
    return lib, isa


class Int8Linear(Linear):
    """W8A8-INT8: y = (q_x @ q_w.T) * s_x[t] * s_w[n], the integer GEMM exact in int32 (as SGLang's GPU kernel).

    Kernels (benchmarks/decode.py measures them):
    - native (``native.py``, int8_gemv.c) over the codes in place: it quantizes the activation itself (the
      learner's formula, bit for bit) and runs a token's k experts in one call (``rows_mm``). With
      AVX512-VNNI it takes one activation row (batch-1 decode: torch's integer kernels cost ~15 us a call
      beyond the GEMM, plus ~25 us of small ops to quantize); on AVX2 machines every row count, because
      oneDNN's u8s8 GEMM without VNNI is ~280x slower than BF16 there and adds pairs of products in
      saturating int16 (its results then differ from the exact product).
    - several rows with VNNI: oneDNN's u8s8 GEMM over a prepacked copy of the codes, where it is exact in this
      process (``_onednn_int8_exact``: not under a DNNL_MAX_CPU_ISA below VNNI, where the native kernel takes every
      row count). The store keeps the checkpoint's codes (checksums, updates; ``refresh()`` re-packs), so int8
      weights are held twice there.
    Without either (and instead of a saturating oneDNN), ``aten._weight_int8pack_mm`` (a weight-only kernel that
    converts every code to float) on the activation dequantized to the compute dtype, as the learner's fake quant.
    """

    def __init__(self, prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype):
        codes = [_take(raw, f"{p}.weight") for p in prefixes]
        scales = [_take(raw, f"{p}.weight_scale").float().reshape(-1, 1) for p in prefixes]
        self.splits = [t.shape[0] for t in codes]
        self.codes_NK = _fuse_rows(prefixes, "weight", codes, store)  # the native and the fallback kernel's operand
        self.scale_N1 = _fuse_rows(prefixes, "weight_scale", scales, store)  # fp32 as exported
        self.names = [f"{p}.{s}" for p in prefixes for s in ("weight", "weight_scale")]
        self.dtype = dtype
        # the native kernel reads the codes and scales in place: contiguous, as made here
        self.gemv, isa = _native_for("int8", dtype)
        self.isa = isa if self.gemv is not None else None
        exact = _onednn_int8_exact()  # oneDNN accumulates in int32 here (VNNI), not in saturating int16
        self.native_rows = self.gemv is not None and (isa != "avx512" or not exact)  # AVX2: no VNNI for oneDNN either
        self.use_onednn = exact and not self.native_rows
        one = f"native int8 {isa}" if self.gemv is not None else None
        many = "oneDNN u8s8 qlinear" if self.use_onednn else "aten._weight_int8pack_mm"
        why = {"avx512": "AVX512-VNNI", "avx2": "AVX2 without AVX512-VNNI"}.get(isa, isa)
        if _onednn_int8() and not exact:
            why += "; oneDNN's u8s8 GEMM saturates here (no VNNI in oneDNN: the CPU's, or DNNL_MAX_CPU_ISA's cap)"
        self.kernel = {"1 row": one or many, "rows": one if self.native_rows else many, "why": why}
        self.refresh()

    def refresh(self) -> None:
        self.w_scale_N = self.scale_N1.view(-1)
        if self.gemv is not None:
            self.plan = self.gemv.gemm("int8", [self.codes_NK], [self.w_scale_N], self.dtype, isa=self.isa)
        if self.use_onednn:
            self.packed = torch.ops.onednn.qlinear_prepack(self.codes_NK, None)
            self.w_zero_N = torch.zeros(self.w_scale_N.shape, dtype=torch.int64)
        # the fallback wants scales in the activation dtype: exact in fp32 mode, bf16-rounded in bf16 mode
        self.scale_N = self.w_scale_N if self.dtype == torch.float32 else self.w_scale_N.to(self.dtype)

    def prepare(self, x_TK: Tensor) -> Tensor | QuantAct:
        if self.use_onednn or self.gemv is not None:
            return QuantAct(x_TK, share=self.use_onednn)
        return dequant_act_int8_per_token(*quant_act_int8_per_token(x_TK), self.dtype)

    def mm(self, x: Tensor | QuantAct) -> Tensor:
        if isinstance(x, QuantAct) and self.gemv is not None and (x.shape[0] == 1 or self.native_rows):
            return self.plan(x.x_TK)
        if not isinstance(x, QuantAct) or not self.use_onednn:
            x_TK = x if not isinstance(x, QuantAct) else dequant_act_int8_per_token(x.q_TK, x.s_T1, self.dtype)
            return torch.ops.aten._weight_int8pack_mm(x_TK, self.codes_NK, self.scale_N)
        qlinear = torch.ops.onednn.qlinear_pointwise
        if x.shape[0] == 1:  # one token: its scale is the tensor's, oneDNN applies it
            return qlinear(x.u8_TK, float(x.s_T1), 128, self.packed, self.w_scale_N, self.w_zero_N, None, 1.0, 0,
                           self.dtype, "none", [], "")
        y_TN = qlinear(x.u8_TK, 1.0, 128, self.packed, self.w_scale_N, self.w_zero_N, None, 1.0, 0, torch.float32,
                       "none", [], "")
        return (y_TN * x.s_T1).to(self.dtype)

    @classmethod
    def rows_mm(cls, linears: list[Linear], x) -> Tensor:
        first: Int8Linear = linears[0]  # type: ignore[assignment]
        if not isinstance(x, QuantAct) or first.gemv is None:
            return super().rows_mm(linears, x)
        y = first.gemv.int8(x.x_TK, [lin.codes_NK for lin in linears],  # type: ignore[attr-defined]
                            [lin.w_scale_N for lin in linears], first.dtype,  # type: ignore[attr-defined]
                            diag=x.shape[0] != 1, isa=first.isa)
        return y.view(len(linears), -1)


class Fp8Linear(Linear):
    """W8A8-FP8, block-quantized weights (B x B blocks of e4m3 codes, fp32 weight_scale_inv per block) and
    activations quantized per token and group of B.

    Native kernel (fp8_gemv.c; AVX2 or AVX-512): SGLang's block-FP8 GEMM over the checkpoint's codes in place,
    1 byte per weight: y = sum over K blocks b of ((sum_k qx * qw) * sx[b]) * sw[b] in fp32, the activation
    quantized inside with the learner's formula (bit for bit), a token's k experts in one call. It takes every
    row count, except on CPUs with oneDNN's bf16 kernels (AVX512-BF16 / AMX), where oneDNN's bf16 GEMM on the
    dequantized weight is faster from 2 rows (measured: 5-8x at 16 rows; at one row the native kernel reads
    half the bytes): there the codes are also dequantized per block into a oneDNN-prepacked bf16 copy (no
    plain one). Without the native kernel: that dequantization on ``PackedDense`` for every row count (2 bytes
    per weight in bf16: no faster than BF16, the exception documented in docs/rollout.md), activations
    quantized and dequantized with the learner's function.
    """

    def __init__(self, prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype, block: int):
        self.prefixes, self.store, self.dtype, self.block = prefixes, store, dtype, block
        for p in prefixes:  # per linear, as loaded: a scale block may straddle two fused linears
            store[f"{p}.weight"] = _take(raw, f"{p}.weight")
            store[f"{p}.weight_scale_inv"] = _take(raw, f"{p}.weight_scale_inv").float()
        self.splits = [store[f"{p}.weight"].shape[0] for p in prefixes]
        self.names = [f"{p}.{s}" for p in prefixes for s in ("weight", "weight_scale_inv")]
        self.gemv, isa = _native_for("fp8", dtype)
        k = store[f"{prefixes[0]}.weight"].shape[1]
        if self.gemv is not None and (block % 16 or k % block):
            self.gemv, isa = None, f"block {block} with K {k} (the kernel wants K a multiple of B, B of 16)"
        self.isa = isa if self.gemv is not None else None
        self.native_rows = 0 if self.gemv is None else 1 if dtype == torch.bfloat16 and _mkldnn_bf16() else 1 << 62
        self.refresh()

    def refresh(self) -> None:
        codes = [self.store[f"{p}.weight"].view(torch.uint8) for p in self.prefixes]
        scales = [self.store[f"{p}.weight_scale_inv"] for p in self.prefixes]
        if self.gemv is not None and not all(t.is_contiguous() for t in codes + scales):
            self.gemv, self.isa, self.native_rows = None, "non-contiguous checkpoint tensors", 0
        if self.gemv is not None:
            self.native_parts = codes, scales
            self.plan = self.gemv.gemm("fp8", codes, scales, self.dtype, isa=self.isa, block=self.block)
        self.gemm = None
        if self.native_rows < 1 << 62:  # the dequantized weight, for more rows (or every row count)
            parts = []
            for p in self.prefixes:
                c = self.store[f"{p}.weight"]
                qw = QuantizedWeight(c, self.store[f"{p}.weight_scale_inv"], None, tuple(c.shape), "w8a8_fp8",
                                     self.block)
                parts.append(dequantize_fp8_block(qw, self.dtype))
            self.gemm = PackedDense(torch.cat(parts) if len(parts) > 1 else parts[0], keep_plain=self.gemv is None)
        native = f"native fp8 {self.isa}" if self.gemv is not None else None
        dense = f"dequantized, {self.gemm.name}" if self.gemm is not None else None
        self.kernel = {"1 row": native or dense, "rows": dense or native,  # type: ignore[dict-item]
                       "why": self.isa if self.gemv is None else
                       f"{self.isa}{'; oneDNN bf16 from 2 rows' if self.gemm is not None else ''}"}

    def prepare(self, x_TK: Tensor) -> Tensor | RowsAct:
        if self.gemv is not None:
            return RowsAct(x_TK)
        return _fake_quant_act_fp8(x_TK, self.block, self.dtype)

    def mm(self, x: Tensor | RowsAct) -> Tensor:
        x_TK = x.x_TK if isinstance(x, RowsAct) else x
        if self.gemv is not None and x_TK.shape[0] <= self.native_rows:
            return self.plan(x_TK)
        if self.gemv is not None:  # the activation as the dense path takes it: quantized, dequantized
            x_TK = _fake_quant_act_fp8(x_TK, self.block, self.dtype)
        return self.gemm(x_TK)  # type: ignore[misc]

    @classmethod
    def rows_mm(cls, linears: list[Linear], x) -> Tensor:
        first: Fp8Linear = linears[0]  # type: ignore[assignment]
        diag = x.shape[0] != 1  # row i through linear i: one fused part each (the experts' down)
        if not isinstance(x, RowsAct) or (diag and any(len(lin.splits) != 1 for lin in linears)):
            return super().rows_mm(linears, x)
        parts = [lin.native_parts for lin in linears]  # type: ignore[attr-defined]
        y = first.gemv.fp8(x.x_TK, [c for p in parts for c in p[0]], [s for p in parts for s in p[1]],  # type: ignore[union-attr]
                           first.block, first.dtype, diag=diag, isa=first.isa)
        return y.view(len(linears), -1)


def _nibbles(packed_RW: Tensor, k: int) -> Tensor:
    """compressed-tensors int32 words -> their 4-bit fields as uint8 [R, k] (the stored field is u = q + 8:
    ``unpack_int4`` without the int64 detour). In a little-endian word, byte j holds fields 2j (low
    nibble) and 2j + 1 (high nibble)."""
    b = packed_RW.contiguous().view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).view(b.shape[0], -1)[:, :k]


def _cpu_int4pack(u_NK: Tensor) -> Tensor:
    """``_convert_weight_to_int4pack_for_cpu`` of u [N, K] (uint8 in [0, 16)) in a few uint8 tensor ops, ~10x
    faster (a weight sync repacks every expert): torch's CPU layout takes rows in blocks of 64; in a block,
    byte (k, j) holds row j in its low nibble and row 32 + j in its high nibble, for column k."""
    n, k = u_NK.shape
    blk = u_NK.view(n // 64, 2, 32, k)
    return (blk[:, 0] | (blk[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


def _fast_int4pack_ok() -> bool:
    """Whether ``_cpu_int4pack`` reproduces this torch build's own conversion (checked once, on random codes)."""
    global _FAST_INT4PACK
    if _FAST_INT4PACK is None:
        u = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, INT4_INNER_K_TILES)
        _FAST_INT4PACK = sys.byteorder == "little" and torch.equal(_cpu_int4pack(u.to(torch.uint8)), ref)
    return _FAST_INT4PACK


_FAST_INT4PACK: bool | None = None


class Int4Linear(Linear):
    """W4A16: y = x @ ((u - 8) * s).T per group of G along K (zero points: (u - 8) * s - z * s).

    bf16 mode: the native kernel (int4_gemv.c) on the checkpoint's words in place, a token's k experts in one
    call, for up to ``native_rows`` activation rows: 1 with AVX512-BF16, 2 with AVX2 (torch's int4 kernel
    streams at ~40-55% of the native one's rate at one row; from 3 rows its 4-row GEMM tiles win, measured on
    1536x2048, 2048x768 and 5120x2048 weights). Above that, in fp32 mode, with zero points or a group that is not
    a multiple of 64: torch's ``_weight_int4pack_mm_for_cpu`` on its own layout (``packed``, ``scale_zeros``,
    made at load)."""

    def __init__(self, prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype):
        self.prefixes, self.store, self.dtype = prefixes, store, dtype
        self.names = []
        for p in prefixes:
            for s in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
                if s != "weight_zero_point" or f"{p}.{s}" in raw:
                    store[f"{p}.{s}"] = _take(raw, f"{p}.{s}")
                    self.names.append(f"{p}.{s}")
        self.refresh()

    def refresh(self) -> None:
        self.splits, group = [], None  # (each part's n; the group size, checked to be shared)
        for p in self.prefixes:
            n, k = (int(v) for v in self.store[f"{p}.weight_shape"].tolist())
            g = k // self.store[f"{p}.weight_scale"].shape[1]
            if group not in (None, g):
                raise ValueError(f"{p}: group size {g} differs from the fused linears' {group}")
            group = g
            self.splits.append(n)
        self.k, self.group = k, group
        self._torch: tuple[Tensor, Tensor] | None = None
        self.native_parts = self._native_parts()
        self._torch_operands()  # at load: torch's kernel runs for more rows

    def _torch_operands(self) -> tuple[Tensor, Tensor]:
        """torch's int4 layout of the weights (uint8 [N, K/2]) and qScaleAndZeros [K/G, N, 2], made once per
        refresh."""
        if self._torch is not None:
            return self._torch
        u_parts, sz_parts = [], []
        for p, n in zip(self.prefixes, self.splits, strict=True):
            scale_NG = self.store[f"{p}.weight_scale"]
            u_parts.append(_nibbles(self.store[f"{p}.weight_packed"], self.k))  # u = q + 8, uint8 in [0, 16)
            zp = self.store.get(f"{p}.weight_zero_point")
            if zp is None:
                zero_NG = torch.zeros_like(scale_NG, dtype=self.dtype)
            else:  # w = (q - z) * s = (u - 8) * s + (-z * s)
                zero_NG = -(unpack_int4(zp, n, packed_dim=0).float() * scale_NG.float()).to(self.dtype)
            sz_parts.append(torch.stack([scale_NG.to(self.dtype), zero_NG], dim=-1))  # [n, K/G, 2]
        u_NK = torch.cat(u_parts) if len(u_parts) > 1 else u_parts[0]
        if u_NK.shape[0] % 64 == 0 and self.k % 2 == 0 and _fast_int4pack_ok():
            packed = _cpu_int4pack(u_NK)  # uint8 [N, K/2], torch's CPU int4 layout
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u_NK.to(torch.int32), INT4_INNER_K_TILES)
        self._torch = packed, torch.cat(sz_parts).transpose(0, 1).contiguous()  # [K/G, N, 2]
        return self._torch

    packed = property(lambda self: self._torch_operands()[0])
    scale_zeros = property(lambda self: self._torch_operands()[1])

    def _native_parts(self) -> list[tuple[Tensor, Tensor]] | None:
        """(4-bit fields as uint8 [n, K/2], bf16 scales [n, K/G]) per fused linear, views of the store, for the
        native kernel; None where it does not apply, and torch's kernel runs instead (``kernel`` says why)."""
        self.native_rows = 0
        kernels, isa = _native_for("int4", self.dtype)
        torch_name = "aten._weight_int4pack_mm_for_cpu"
        self.kernel = {"1 row": torch_name, "rows": torch_name, "why": isa}
        if kernels is None:
            return None
        why = None
        if self.dtype != torch.bfloat16 or sys.byteorder != "little":
            why = "fp32 mode (the native kernel takes bf16 activations)"
        elif self.group % 64 or self.k % self.group:
            why = f"group {self.group} (the native kernel wants a multiple of 64)"
        parts = []
        for p in self.prefixes:
            words, scale = self.store[f"{p}.weight_packed"], self.store[f"{p}.weight_scale"]
            if f"{p}.weight_zero_point" in self.store or scale.dtype != torch.bfloat16:
                why = why or "zero points or non-bf16 scales"
            elif not (words.is_contiguous() and scale.is_contiguous()) or words.shape[1] * 8 != self.k:
                why = why or "non-contiguous or padded checkpoint tensors"
            parts.append((words.view(torch.uint8), scale))  # little-endian: byte j = u[2j] | u[2j + 1] << 4
        if why is not None:
            self.kernel["why"] = why
            return None
        self.kernels, self.isa = kernels, isa
        self.native_rows = 1 if isa == "avx512" else 2
        self.plan = kernels.gemm("int4", [w for w, _ in parts], [s for _, s in parts], self.dtype, isa=isa,
                                 block=self.group)
        name = f"native int4 {isa}"
        self.kernel = {"1 row": name, "rows": f"{name} up to 2 rows, {torch_name} above" if self.native_rows > 1
                       else torch_name, "why": "AVX512-BF16" if isa == "avx512" else "AVX2 without AVX512-BF16"}
        return parts

    def mm(self, x_TK: Tensor) -> Tensor:
        if self.native_parts is not None and x_TK.shape[0] <= self.native_rows:  # [T, N]: gate | up
            return self.plan(x_TK)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x_TK.contiguous(), self.packed, self.group,
                                                          self.scale_zeros)

    def _native(self, linears: list[Int4Linear], x_TK: Tensor, diag: bool) -> Tensor:
        parts = [part for lin in linears for part in lin.native_parts]  # type: ignore[union-attr]
        return self.kernels.int4(x_TK, [w for w, _ in parts], [s for _, s in parts], self.group, self.dtype,
                                 diag=diag, isa=self.isa)

    @classmethod
    def rows_mm(cls, linears: list[Linear], x) -> Tensor:
        """One native call for a token's k experts (gate_up: the token through 2k linears; down: row i
        through expert i's), where every linear takes the native kernel with the same shapes."""
        first: Int4Linear = linears[0]  # type: ignore[assignment]
        same = all(isinstance(lin, Int4Linear) and lin.native_parts is not None and lin.splits == first.splits
                   and lin.k == first.k and lin.group == first.group for lin in linears)
        if not same or (x.shape[0] != 1 and len(first.splits) != 1):
            return super().rows_mm(linears, x)
        return first._native(linears, x, diag=x.shape[0] != 1).view(len(linears), -1)  # type: ignore[arg-type]


_LOGGED: set[tuple[str, ...]] = set()  # (format, kernels, why) already logged at INFO


def make_linear(prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype, fp8_block: int | None) -> Linear:
    """The layer for HF linears ``prefixes`` (fused along N), moving their tensors from ``raw`` to ``store``.
    Logs the kernel it runs on (INFO the first time a format gets a kernel in this process, DEBUG for every
    layer) and, the first time a low-bit format meets a weight shape, checks it against BF16
    (``speed_check``)."""
    formats = {detect_format(p, raw) for p in prefixes}
    if len(formats) != 1:
        raise ValueError(f"{prefixes}: cannot fuse linears stored in different formats {sorted(formats)}")
    fmt = formats.pop()
    if fmt == "w4a16":
        lin: Linear = Int4Linear(prefixes, raw, store, dtype)
    elif fmt == "w8a8_int8":
        lin = Int8Linear(prefixes, raw, store, dtype)
    elif fmt == "w8a8_fp8":
        if fp8_block is None:
            raise ValueError(f"{prefixes[0]}: fp8 weights but no weight_block_size in quantization_config")
        lin = Fp8Linear(prefixes, raw, store, dtype, fp8_block)
    else:
        lin = DenseLinear(prefixes, raw, store, dtype)
    k = lin.kernel
    line = (f"{fmt} {'+'.join(p.rsplit('.', 1)[-1] for p in prefixes)}: 1 row on {k['1 row']}, several rows on "
            f"{k['rows']} ({k['why']})")
    log.debug("%s: %s", prefixes[0].rsplit(".", 1)[0], line)
    if (fmt, k["1 row"], k["rows"], k["why"]) not in _LOGGED:
        _LOGGED.add((fmt, k["1 row"], k["rows"], k["why"]))
        log.info("kernels: %s", line)
    if fmt != "dense":
        rows = speed_check.EXPERT_ROWS if ".experts." in prefixes[0] else speed_check.ROWS
        speed_check.check(fmt, lin, sum(lin.splits), _in_features(lin, store), dtype, PackedDense, rows)
    return lin


def _in_features(lin: Linear, store: Store) -> int:
    """K of a low-bit layer (from its first store entry of weight codes)."""
    if isinstance(lin, Int4Linear):
        return lin.k
    return store[lin.names[0]].shape[1]
