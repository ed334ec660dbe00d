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
                 weight_shape as loaded; the kernel operand is torch's CPU int4 layout
                 (``_convert_weight_to_int4pack_for_cpu``, uint8 [N, K/2]) with qScaleAndZeros [K/G, N, 2]
                 (scale, zero = 0: w = (u - 8) * scale), run by ``_weight_int4pack_mm_for_cpu``.
                 No bf16/fp32 copy of the weight exists at any time.
    Int8Linear   W8A8-INT8: codes int8 [N, K] (store views), per-channel scales; activations quantized per
                 token by ``qat.quantizer.quant_act_int8_per_token``; the integer GEMM runs on oneDNN's
                 u8s8 kernel over a prepacked copy of the codes, or (one token) on the native kernel
                 (``native.py``) over the codes in place (fallback: ``_weight_int8pack_mm``).
    Fp8Linear    W8A8-FP8: the store holds the e4m3 codes and weight_scale_inv; the operand is their
                 per-block dequantization in the compute dtype (the exception documented in
                 docs/rollout.md: torch's CPU fp8 GEMM is a ~50x slower reference path). Operands equal the
                 GPU kernel's; activations are quantized per token group with the learner's function.
"""

from __future__ import annotations

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
from megatron_qarl.rollout import native

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
    """Base: ``names`` are the store entries this layer reads; ``splits`` the N of each fused linear."""

    names: list[str]
    splits: list[int]

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
    fp32 (the exactness mode) keeps ``F.linear`` (MKL), which is what transformers runs.
    """

    def __init__(self, w_NK: Tensor):
        self.w_NK = w_NK
        self.use_packed = w_NK.dtype == torch.bfloat16 and _mkldnn_bf16()
        self.refresh()

    def refresh(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w_NK, None) if self.use_packed else None

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

    def refresh(self) -> None:
        self.gemm.refresh()

    def mm(self, x_TK: Tensor) -> Tensor:
        return self.gemm(x_TK)


class QuantAct:
    """A W8A8-INT8 activation, quantized per token when first needed (``quant_act_int8_per_token``):
    int8 codes ``q_TK``, fp32 scales ``s_T1``, and the codes shifted to uint8, ``u8_TK = q + 128``, which
    oneDNN's u8s8 GEMM takes with zero point 128 (so it computes with q exactly). The native kernel
    takes ``x_TK`` and quantizes it itself, the same way. Taking rows (``x[rows]``, ``x[a:b]``, as the
    batched MoE does per expert) quantizes all rows first, once."""

    def __init__(self, x_TK: Tensor):
        self.x_TK = x_TK
        self._q: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x_TK.shape

    def _quantized(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._q is None:
            q_TK, s_T1 = quant_act_int8_per_token(self.x_TK)
            self._q = q_TK, s_T1, torch.bitwise_xor(q_TK.view(torch.uint8), 128)  # = q + 128 as uint8
        return self._q

    q_TK = property(lambda self: self._quantized()[0])
    s_T1 = property(lambda self: self._quantized()[1])
    u8_TK = property(lambda self: self._quantized()[2])

    def __getitem__(self, rows) -> QuantAct:
        part = QuantAct(self.x_TK[rows])
        part._q = tuple(t[rows] for t in self._quantized())  # type: ignore[assignment]
        return part


def _onednn_int8() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


class Int8Linear(Linear):
    """W8A8-INT8: y = (q_x @ q_w.T) * s_x[t] * s_w[n], the integer GEMM exact in int32 (as SGLang's GPU kernel).

    Two integer kernels (benchmarks/decode.py measures both):
    - one token (batch-1 decode): the native kernel of ``native.py`` over the codes in place. It quantizes
      the activation itself (the learner's formula, bit for bit) and runs a token's k experts in one call
      (``rows_mm``): torch's integer kernels cost ~15 us a call beyond the GEMM, plus ~25 us of small ops
      to quantize, against 40-90 us of weight streaming per expert GEMM.
    - more rows, or no native kernel: oneDNN's u8s8 GEMM (VNNI) over a prepacked copy of the codes. The
      store keeps the checkpoint's codes (checksums, updates; ``refresh()`` re-packs), so int8 weights are
      held twice.
    Without oneDNN the fallback is ``aten._weight_int8pack_mm`` (a weight-only kernel that converts
    every code to float) on the activation dequantized to the compute dtype, as the learner's fake quant.
    """

    def __init__(self, prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype):
        codes = [_take(raw, f"{p}.weight") for p in prefixes]
        scales = [_take(raw, f"{p}.weight_scale").float().reshape(-1, 1) for p in prefixes]
        self.splits = [t.shape[0] for t in codes]
        self.codes_NK = _fuse_rows(prefixes, "weight", codes, store)  # the native and the fallback kernel's operand
        self.scale_N1 = _fuse_rows(prefixes, "weight_scale", scales, store)  # fp32 as exported
        self.names = [f"{p}.{s}" for p in prefixes for s in ("weight", "weight_scale")]
        self.dtype = dtype
        self.use_onednn = _onednn_int8()
        # the native one-token kernel (native.py) reads the codes and scales in place: contiguous, as made here.
        # Only with VNNI: its plain C loop (other CPUs) is a test reference, slower than oneDNN.
        lib = native.load() if dtype in (torch.bfloat16, torch.float32) else None
        self.gemv = lib if lib is not None and lib.vnni else None
        self.refresh()

    def refresh(self) -> None:
        self.w_scale_N = self.scale_N1.view(-1)
        if self.use_onednn:
            self.packed = torch.ops.onednn.qlinear_prepack(self.codes_NK, None)
            self.w_zero_N = torch.zeros(self.w_scale_N.shape, dtype=torch.int64)
        # the fallback wants scales in the activation dtype: exact in fp32 mode, bf16-rounded in bf16 mode
        self.scale_N = self.w_scale_N if self.dtype == torch.float32 else self.w_scale_N.to(self.dtype)

    def prepare(self, x_TK: Tensor) -> Tensor | QuantAct:
        if self.use_onednn or self.gemv is not None:
            return QuantAct(x_TK)
        return dequant_act_int8_per_token(*quant_act_int8_per_token(x_TK), self.dtype)

    def mm(self, x: Tensor | QuantAct) -> Tensor:
        if isinstance(x, QuantAct) and x.shape[0] == 1 and self.gemv is not None:
            return self.gemv.int8(x.x_TK, [self.codes_NK], [self.w_scale_N], self.dtype)
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
        return first.gemv.int8(x.x_TK, [lin.codes_NK for lin in linears],  # type: ignore[attr-defined]
                          [lin.w_scale_N for lin in linears], first.dtype)  # type: ignore[attr-defined]


class Fp8Linear(Linear):
    def __init__(self, prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype, block: int):
        self.prefixes, self.store, self.dtype, self.block = prefixes, store, dtype, block
        for p in prefixes:  # per linear, as loaded: a scale block may straddle two fused linears
            store[f"{p}.weight"] = _take(raw, f"{p}.weight")
            store[f"{p}.weight_scale_inv"] = _take(raw, f"{p}.weight_scale_inv").float()
        self.splits = [store[f"{p}.weight"].shape[0] for p in prefixes]
        self.names = [f"{p}.{s}" for p in prefixes for s in ("weight", "weight_scale_inv")]
        self.refresh()

    def refresh(self) -> None:
        parts = []
        for p in self.prefixes:
            codes = self.store[f"{p}.weight"]
            qw = QuantizedWeight(codes, self.store[f"{p}.weight_scale_inv"], None, tuple(codes.shape),
                                 "w8a8_fp8", self.block)
            parts.append(dequantize_fp8_block(qw, self.dtype))
        self.w_NK = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.gemm = PackedDense(self.w_NK)

    def prepare(self, x_TK: Tensor) -> Tensor:
        codes_TK, s_TG = quant_act_fp8_per_token_group(x_TK, self.block)
        return dequant_act_fp8_per_token_group(codes_TK, s_TG, self.dtype)

    def mm(self, x_TK: Tensor) -> Tensor:
        return self.gemm(x_TK)


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
        u_parts, sz_parts, self.splits = [], [], []
        group = None
        for p in self.prefixes:
            n, k = (int(v) for v in self.store[f"{p}.weight_shape"].tolist())
            scale_NG = self.store[f"{p}.weight_scale"]
            g = k // scale_NG.shape[1]
            if group not in (None, g):
                raise ValueError(f"{p}: group size {g} differs from the fused linears' {group}")
            group = g
            u_parts.append(_nibbles(self.store[f"{p}.weight_packed"], k))  # u = q + 8, uint8 in [0, 16)
            zp = self.store.get(f"{p}.weight_zero_point")
            if zp is None:
                zero_NG = torch.zeros_like(scale_NG, dtype=self.dtype)
            else:  # w = (q - z) * s = (u - 8) * s + (-z * s)
                zero_NG = -(unpack_int4(zp, n, packed_dim=0).float() * scale_NG.float()).to(self.dtype)
            sz_parts.append(torch.stack([scale_NG.to(self.dtype), zero_NG], dim=-1))  # [n, K/G, 2]
            self.splits.append(n)
        u_NK = torch.cat(u_parts) if len(u_parts) > 1 else u_parts[0]
        self.k, self.group = u_NK.shape[1], group
        if u_NK.shape[0] % 64 == 0 and self.k % 2 == 0 and _fast_int4pack_ok():
            self.packed = _cpu_int4pack(u_NK)  # uint8 [N, K/2], torch's CPU int4 layout
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u_NK.to(torch.int32), INT4_INNER_K_TILES)
        self.scale_zeros = torch.cat(sz_parts).transpose(0, 1).contiguous()  # [K/G, N, 2]
        self.native_parts = self._native_parts()

    def _native_parts(self) -> list[tuple[Tensor, Tensor]] | None:
        """(4-bit fields as uint8 [n, K/2], bf16 scales [n, K/G]) per fused linear, views of the store, for the
        native one-token kernel; None where it does not apply (fp32 mode, zero points, a group that is not
        a multiple of 64, fused linears of different n, no AVX512-BF16), and torch's kernel runs instead."""
        kernels = native.load()
        if kernels is None or not kernels.int4_ok or self.dtype != torch.bfloat16 or sys.byteorder != "little":
            return None
        if self.group % 64 or self.k % self.group or len(set(self.splits)) != 1:
            return None
        parts = []
        for p in self.prefixes:
            words, scale = self.store[f"{p}.weight_packed"], self.store[f"{p}.weight_scale"]
            if f"{p}.weight_zero_point" in self.store or scale.dtype != torch.bfloat16:
                return None
            if not (words.is_contiguous() and scale.is_contiguous()) or words.shape[1] * 8 != self.k:
                return None
            parts.append((words.view(torch.uint8), scale))  # little-endian: byte j = u[2j] | u[2j + 1] << 4
        self.kernels = kernels
        return parts

    def mm(self, x_TK: Tensor) -> Tensor:
        if self.native_parts is not None and x_TK.shape[0] == 1:  # [parts, n] -> [1, N]: gate | up
            return self._native([self], x_TK).view(1, -1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x_TK.contiguous(), self.packed, self.group,
                                                          self.scale_zeros)

    def _native(self, linears: list[Int4Linear], x_TK: Tensor) -> Tensor:
        parts = [part for lin in linears for part in lin.native_parts]  # type: ignore[union-attr]
        return self.kernels.int4(x_TK, [w for w, _ in parts], [s for _, s in parts], self.group, self.dtype)

    @classmethod
    def rows_mm(cls, linears: list[Linear], x) -> Tensor:
        """One native call for a token's k experts (gate_up: the token through 2k linears; down: row i
        through expert i's), where every linear takes the native kernel with the same shapes."""
        first: Int4Linear = linears[0]  # type: ignore[assignment]
        same = all(isinstance(lin, Int4Linear) and lin.native_parts is not None and lin.splits == first.splits
                   and lin.k == first.k and lin.group == first.group for lin in linears)
        if not same or (x.shape[0] != 1 and len(first.splits) != 1):
            return super().rows_mm(linears, x)
        return first._native(linears, x).view(len(linears), -1)  # type: ignore[arg-type]


def make_linear(prefixes: list[str], raw: Store, store: Store, dtype: torch.dtype, fp8_block: int | None) -> Linear:
    """The layer for HF linears ``prefixes`` (fused along N), moving their tensors from ``raw`` to ``store``."""
    formats = {detect_format(p, raw) for p in prefixes}
    if len(formats) != 1:
        raise ValueError(f"{prefixes}: cannot fuse linears stored in different formats {sorted(formats)}")
    fmt = formats.pop()
    if fmt == "w4a16":
        return Int4Linear(prefixes, raw, store, dtype)
    if fmt == "w8a8_int8":
        return Int8Linear(prefixes, raw, store, dtype)
    if fmt == "w8a8_fp8":
        if fp8_block is None:
            raise ValueError(f"{prefixes[0]}: fp8 weights but no weight_block_size in quantization_config")
        return Fp8Linear(prefixes, raw, store, dtype, fp8_block)
    return DenseLinear(prefixes, raw, store, dtype)
