"""The engine's forward under ``numerics: exact``: every token through numerics/ (the learner's moe/exact.py
computes with the same functions), so a token's logits do not depend on the batch it is in, on prefill vs decode,
or on a retract and re-prefill.

Each linear multiplies float32 operands: dense weights as the store holds them (the compute dtype, bf16 on bf16
servers), low-bit ones dequantized from the checkpoint's codes with the one quantizer's functions (W4A16:
``dequantize_w4a16``; INT8: ``dequantize_int8_channel``; FP8: ``dequantize_fp8_block``), computed once per weight
version. W8A8 activations are quantized per token (group) with the learner's formulas (``numerics.ops.quant_act``).
The KV cache holds float32 (values already rounded to the compute dtype; with an FP8 cache, the values it reads
back: qat/kv_cache.py, exact.c ``qx_kv_round_row``); attention reads exactly a query's keys.

A layer is two calls of exact.c (its attention block and its MoE block), not the dozens of torch ops and kernel
calls the learner's autograd path makes: at decode those calls, not the arithmetic, were the time (the tiny model's
batch-1 step went from 4.1 to 0.4 ms). The blocks run each row with the same kernels, in the same order, so the
learner's bits are unchanged (tests/test_numerics_exact.py compares the two, and each block with the composition of
numerics/ops.py it replaces).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron_qarl.numerics import layers, native, ops
from megatron_qarl.qat.pack import unpack_int4
from megatron_qarl.qat.quantizer import (
    QuantizedWeight,
    dequantize_fp8_block,
    dequantize_int8_channel,
    dequantize_w4a16,
)
from megatron_qarl.serve.kernels.linear import DenseLinear, Fp8Linear, Int4Linear, Int8Linear, Linear

# the engine model (serve/model.py Qwen3MoeEngineModel) and its layers, which import this module: typed loosely
EngineModel = Any
Layer = Any


def dequantized(lin: Linear) -> Tensor:
    """A linear's weight [N, K] as float32, from the store's tensors (fused parts concatenated along N)."""
    if isinstance(lin, DenseLinear):
        return lin.w_NK.float()
    if isinstance(lin, Int8Linear):
        return dequantize_int8_channel(QuantizedWeight(lin.codes_NK, lin.scale_N1, None, tuple(lin.codes_NK.shape),
                                                       "w8a8_int8"), torch.float32)
    parts = []
    for p in lin.prefixes:  # type: ignore[attr-defined]
        s = lin.store  # type: ignore[attr-defined]
        if isinstance(lin, Int4Linear):
            n, k = (int(v) for v in s[f"{p}.weight_shape"].tolist())
            zp = s.get(f"{p}.weight_zero_point")
            qw = QuantizedWeight(unpack_int4(s[f"{p}.weight_packed"], k), s[f"{p}.weight_scale"],
                                 None if zp is None else unpack_int4(zp, n, packed_dim=0), (n, k), "w4a16", lin.group)
            parts.append(dequantize_w4a16(qw).float())
        elif isinstance(lin, Fp8Linear):
            c = s[f"{p}.weight"]
            qw = QuantizedWeight(c, s[f"{p}.weight_scale_inv"], None, tuple(c.shape), "w8a8_fp8", lin.block)
            parts.append(dequantize_fp8_block(qw, torch.float32))
        else:
            raise TypeError(f"{type(lin).__name__}: no exact weight")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def act_scheme(lin: Linear) -> tuple[str, int | None]:
    """(scheme, group) of the activation quantization a linear's format asks for (none: ("bf16", None))."""
    if isinstance(lin, Int8Linear):
        return "w8a8_int8", None
    if isinstance(lin, Fp8Linear):
        return "w8a8_fp8", lin.block
    return "bf16", None


class ExactForward:
    """The exact forward of one engine model (its store, linears and float32 KV cache)."""

    def __init__(self, model: EngineModel):
        native.lib()  # build the kernels now: a server that cannot be exact fails at start, not at its first request
        self.m, self.act = model, model.dtype
        a = model.arch
        if model.k_cache.shape[3] > a.max_position_embeddings:  # the rope tables end there (a start-time refusal)
            raise ValueError(f"numerics: exact: a KV cache of {model.k_cache.shape[3]} positions is longer than "
                             f"config.json max_position_embeddings={a.max_position_embeddings}")
        self.cos, self.sin = ops.rope_tables(a.max_position_embeddings, a.head_dim, a.rope_theta)
        self._w: dict[int, Tensor] = {}
        self._v: dict[str, Tensor] = {}
        self._blocks: dict[int, tuple[native.AttnBlock, native.MoeBlock]] = {}

    def invalidate(self) -> None:
        """Forget the float32 weights and the blocks set up on them (after a weight update)."""
        self._w.clear()
        self._v.clear()
        self._blocks.clear()

    def vec(self, name: str) -> Tensor:
        """A norm's weight from the store as float32, kept until the next weight update (a decode step would
        otherwise convert every norm of every layer again)."""
        if name not in self._v:
            self._v[name] = self.m.store[name].float()
        return self._v[name]

    def w(self, lin: Linear) -> Tensor:
        """A linear's float32 weight [N, K], held K-major (what exact.c reads) and given as its transposed view: one
        float32 copy per weight, not an [N, K] one and a K-major one."""
        if id(lin) not in self._w:
            self._w[id(lin)] = dequantized(lin).t().contiguous().t()
        return self._w[id(lin)]

    def blocks(self, layer: Layer) -> tuple[native.AttnBlock, native.MoeBlock]:
        """The layer's attention and MoE blocks, each one call of exact.c (``qx_attn_block`` / ``qx_moe_block``:
        norm, linears, rope, attention or routing and experts, residual, in the order and with the rounding points of
        numerics/layers.py, which the learner composes from the same kernels), set up once per weight version."""
        if layer.index not in self._blocks:
            a, m = self.m.arch, self.m
            norm = f"{layer.prefix}.self_attn"
            attn = native.AttnBlock(self.vec(f"{layer.prefix}.input_layernorm.weight"), a.rms_norm_eps,
                                    self.w(layer.qkv), act_scheme(layer.qkv), self.vec(f"{norm}.q_norm.weight"),
                                    self.vec(f"{norm}.k_norm.weight"), self.cos, self.sin, m.k_cache[layer.index],
                                    m.v_cache[layer.index], a.num_attention_heads, self.w(layer.o), act_scheme(layer.o),
                                    ops.CHUNK, self.act, (m.kv_dtype, *m.kv_scales[layer.index]))
            gu_q, down_q = act_scheme(layer.gate_up[0]), act_scheme(layer.down[0])
            if any(act_scheme(g) != gu_q for g in layer.gate_up) or any(act_scheme(d) != down_q for d in layer.down):
                raise ValueError(f"layer {layer.index}: its experts' linears are not all of one format")
            moe = native.MoeBlock(self.vec(f"{layer.prefix}.post_attention_layernorm.weight"), a.rms_norm_eps,
                                  self.w(layer.router), a.num_experts_per_tok, a.norm_topk_prob,
                                  [self.w(g) for g in layer.gate_up], [self.w(d) for d in layer.down], gu_q, down_q,
                                  ops.CHUNK, self.act)
            self._blocks[layer.index] = (attn, moe)
        return self._blocks[layer.index]

    @torch.inference_mode()
    def forward(self, tokens_BT: Tensor, slots_B: Tensor, pos_BT: Tensor, all_logits: bool) -> Tensor:
        """``Qwen3MoeEngineModel.forward`` in exact numerics: fp32 logits [B, V] of each row's last token (all
        tokens [B, T, V] when ``all_logits``)."""
        m, a = self.m, self.m.arch
        b, t = tokens_BT.shape
        s, eps, act = m.store, a.rms_norm_eps, self.act
        x = ops.round_to(s["model.embed_tokens.weight"][tokens_BT.reshape(-1)].float(), act)  # the rows only
        slots_R, pos_R = slots_B[:, None].expand(b, t).reshape(-1), pos_BT.reshape(-1)
        rows = native.CacheRows(pos_R, slots_R, *m.k_cache.shape[1:4:2])  # checked once for every layer
        x = x.contiguous()
        for layer in m.layers:
            attn, moe = self.blocks(layer)
            attn(x, rows)
            order = moe(x)
            if m.capture is not None:
                m.capture.append(order.to(torch.int32))
        x = x.view(b, t, -1) if all_logits else x.view(b, t, -1)[:, -1:]
        x = layers.norm(x.reshape(-1, a.hidden_size), self.vec("model.norm.weight"), eps, act)
        logits = ops.linear(x, self.w(m.lm_head))
        return logits.view(b, -1, a.vocab_size) if all_logits else logits
