"""The local spec's core attention on torch's fused ``scaled_dot_product_attention`` (``model.attention``).

Without Transformer Engine the learner builds Megatron's local spec, whose core attention is ``DotProductAttention``:
unfused (baddbmm, masked softmax in fp32, bmm), the s x s scores of every head held for the backward and K / V
repeated to every query head. ``SDPAttention`` takes its place through the layer spec (``moe.model.layer_spec``) and
computes the same function with torch's SDPA, which picks a fused kernel: flash / cuDNN / memory-efficient on CUDA,
a flash kernel on CPU (``_scaled_dot_product_flash_attention_for_cpu``). For query heads q_h, key / value group
g(h) = h // (np / ng) and the causal mask (key j <= query i):

    out[i, h] = sum_j softmax_j(scale * q_h[i] . k_g(h)[j]) v_g(h)[j],   scale = softmax_scale or 1 / sqrt(hn)

- **GQA** without repeated K / V (``grouped_sdpa``): on CUDA ``enable_gqa`` (the kernel reads group g(h) for head
  h); on CPU each group's query heads over that group's K / V as a stride-0 view (torch's CPU flash backward with
  ``enable_gqa`` is several times slower).
- **Tensor parallel**: the heads of this rank (np = a / TP, ng = g / TP, as Megatron's ``Attention`` hands them);
  sequence parallel is Megatron's: the attention runs on the gathered sequence, as the unfused one does.
- **Scale and dtype** as Megatron's: the net scale of ``DotProductAttention`` (``apply_query_key_layer_scaling``
  divides the scores by the layer number and its fp32 softmax multiplies them back, so it is 1 / sqrt(hn) either
  way), the softmax in fp32 (its ``attention_softmax_in_fp32``; the fused kernels accumulate in fp32), the output in
  the inputs' dtype.
- **Masks**: with a causal mask type the kernel's own causal mask is used and ``attention_mask`` is not read, as
  Transformer Engine's attention does with Megatron's causal type (the learner passes None: no s x s mask is made);
  ``no_mask`` attends everywhere; the padding / arbitrary types take ``attention_mask`` (True where attention is not
  allowed, Megatron's convention), which on CUDA leaves the flash kernel (GQA with a mask runs the math kernel).
- **K / V** arrive as Megatron's ``Attention`` hands them to its core attention (after RoPE, and after whatever it
  does to them before: a KV-cache fake quant there applies to this module's inputs exactly as to the unfused one's).
- **Call signature**: megatron-core 0.16.1's core-attention protocol (``transformer/attention.py``
  ``CoreAttention``): ``(query, key, value, attention_mask, attn_mask_type=, attention_bias=,
  packed_seq_params=)``, [sq, b, np|ng, hn] in, [sq, b, np * hn] out; Megatron's selective recompute of
  ``core_attn`` calls it the same way inside its checkpoint. ``attention_bias`` is refused, as
  ``DotProductAttention`` refuses it. ``packed_seq_params`` (THD, packed sequences: ``learner/packing.py``) runs
  each sequence causally on its own tokens, a block-diagonal causal mask (``SDPAttention._packed``);
  ``DotProductAttention`` refuses it, so the unfused learner does not pack.

What it keeps for the backward (the kernel's saved tensors): q, k, v (k and v per group, not per head: V is made
contiguous first, so Megatron's fused qkv output it is a view of is not held for it), the output and the fp32
log-sum-exp per (head, query): no s^2 tensor. ``plan.memory`` counts it as the local spec with the ``sdpa``
attention.

``model.attention`` (``ATTENTIONS``): ``auto`` = sdpa on the local spec; ``sdpa``; ``unfused`` = Megatron's
``DotProductAttention``. They choose the local spec's core attention: ``model.impl: te`` builds TE's (fused) attention
and takes ``auto`` only (``check_attention``), and an explicit sdpa / unfused makes ``model.impl: auto`` build the
local spec (``moe.te.resolve_impl``). ``numerics: exact`` computes attention with its own kernels
(``numerics/exact.c``) and ignores the key.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from megatron_qarl.errors import ConfigError

ATTENTIONS = ("auto", "sdpa", "unfused")


def check_attention(attention: str, impl: str) -> None:
    """``model.attention`` against ``model.impl``: ConfigError naming both keys for an explicit local-spec attention
    (sdpa, unfused) with the Transformer Engine spec, whose attention is TE's own."""
    if attention not in ATTENTIONS:
        raise ConfigError(f"model.attention: {attention!r} is not one of {', '.join(ATTENTIONS)}")
    if attention != "auto" and impl == "te":
        raise ConfigError(f"model.attention: {attention!r} chooses the core attention of Megatron's local spec, but "
                          "model.impl=te builds Transformer Engine's layers, whose attention is TE's fused one; use "
                          "model.attention=auto with model.impl=te, or model.impl=local")


def resolve_attention(attention: str, impl: str) -> str:
    """The core attention a learner builds, from ``model.attention`` and the resolved layer spec ``impl`` (local /
    te): "te" (TE's), "sdpa" (``SDPAttention``) or "unfused" (Megatron's ``DotProductAttention``)."""
    check_attention(attention, impl)
    if impl == "te":
        return "te"
    return "unfused" if attention == "unfused" else "sdpa"


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None, causal: bool,
                 scale: float, native_gqa: bool) -> torch.Tensor:
    """SDPA of q [b, np, s, hn] over k, v [b, ng, s, hn], query head h on group h // r (r = np / ng), without
    repeating K / V in memory: ``native_gqa`` (CUDA) hands the groups to the kernel (``enable_gqa``: flash attention
    reads group h // r for head h); otherwise (CPU) each group's r query heads become one batch entry over that
    group's K / V expanded to r heads, a view (stride 0):

        q -> [b * ng, r, s, hn] (a view of Megatron's [s, b, np, hn] layout),  k, v -> [b * ng, 1, s, hn] -> expand r

    because torch's CPU flash backward with ``enable_gqa`` parallelises over the KV groups only (measured on this
    project's 2-core machine, 8 query heads on 1 group, 4096 tokens, bf16: 3.9 s against 0.47 s for the same forward
    + backward; BENCHMARKS.md). Its backward sums each group's r head gradients (autograd's expand), transient.
    With a mask (padding / arbitrary types) the kernel takes the groups itself."""
    b, heads, s, d = q.shape
    groups = k.shape[1]
    if heads == groups or native_gqa or mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=heads != groups)
    r = heads // groups
    kg, vg = (t.reshape(b * groups, 1, t.shape[2], d).expand(-1, r, -1, -1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.reshape(b * groups, r, s, d), kg, vg, is_causal=causal, scale=scale)
    return out.reshape(b, heads, s, d)


HALF = (torch.float16, torch.bfloat16)  # the dtypes of the CUDA flash kernels (varlen_attn, SDPA's GQA on CUDA)


@functools.cache
def _varlen_kernel():
    """torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``, CUDA) where it takes what
    ``SDPAttention`` hands it (torch 2.13's signature: ``scale``, ``window_size``, ``enable_gqa``), else None: a torch
    without it, or an older one (torch 2.10's takes ``is_causal`` and no ``window_size``; a GPU image may bring its own
    torch), runs the per-sequence loop instead."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if not {"scale", "window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters):
        return None
    return varlen_attn


def _varlen_attn(t: torch.Tensor):
    """``_varlen_kernel`` for operands ``t`` it takes: fp16 / bf16 only (flash attention's dtypes), else None."""
    return _varlen_kernel() if t.dtype in HALF else None


def _native_gqa(t: torch.Tensor) -> bool:
    """Whether SDPA takes ``t``'s grouped query heads itself (``enable_gqa``): CUDA's flash kernel, fp16 / bf16 only
    (torch's scaled_dot_product_attention: GQA "works only for Flash_attention and math kernel on CUDA"; in float32 it
    would run the math kernel, s^2 scores and repeated K / V), else the expanded-view path of ``grouped_sdpa``."""
    return _cuda_kernels(t) and t.dtype in HALF


def _cuda_kernels(t: torch.Tensor) -> bool:
    """Whether ``t``'s kernels are CUDA's: a CUDA tensor of a CUDA build of torch (the simulated device's tensors
    report CUDA on a CPU build, whose kernels are the CPU's: gpu/simulated_device.py)."""
    return t.is_cuda and torch.version.cuda is not None


class SDPAttention(torch.nn.Module):
    """Megatron's core attention of the local spec on ``torch.nn.functional.scaled_dot_product_attention`` (module
    docstring). Built by Megatron's ``Attention`` with the core-attention builder's keyword arguments. No parameters
    or buffers (a plain module: Megatron's sharded state dict of a layer takes it as an empty one), so checkpoints of
    the sdpa and the unfused attention are the same."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        """Megatron's builder arguments; the heads arrive split over TP already (``Attention`` splits q, k, v), so
        ``pg_collection`` and the self / cross ``attention_type`` change nothing here."""
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {"context_parallel_size": (config.context_parallel_size, config.context_parallel_size != 1),
                       "window_size": (config.window_size, is_layer_window_attention(
                           config.window_size, config.window_attn_skip_freq, layer_number)),
                       "softmax_type": (config.softmax_type, config.softmax_type != "vanilla"),
                       "attention_dropout": (dropout, dropout != 0.0)}
        bad = [(k, v) for k, (v, refused) in unsupported.items() if refused]
        if bad:
            raise ValueError(f"SDPAttention (model.attention sdpa): TransformerConfig.{bad[0][0]}={bad[0][1]!r} is not "
                             "supported (context parallel 1, no sliding window, vanilla softmax, no attention dropout)")
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias: torch.Tensor | None = None,
                packed_seq_params=None) -> torch.Tensor:
        """[sq, b, np, hn] query, [sk, b, ng, hn] key / value -> [sq, b, np * hn] (module docstring)."""
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported (neither is it by Megatron's "
                             "DotProductAttention)")
        if packed_seq_params is not None:
            return self._packed(query, key, value, attn_mask_type or self.attn_mask_type, packed_seq_params)
        mask, causal = self._mask(attn_mask_type or self.attn_mask_type, attention_mask, query.shape[0],
                                  key.shape[0])
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.contiguous().permute(1, 2, 0, 3)  # a view of the fused qkv output: keep only V's own bytes
        out = grouped_sdpa(q, k, v, mask=mask, causal=causal, scale=self.softmax_scale, native_gqa=_native_gqa(q))
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask_type, params) -> torch.Tensor:
        """Packed sequences (Megatron's THD format, ``learner/packing.py``): [t, np, hn] query, [t, ng, hn] key /
        value of sequences laid end to end, sequence i at cu_seqlens[i]:cu_seqlens[i+1]; each attends causally to
        its own tokens only (a block-diagonal causal mask) -> [t, np * hn]. CUDA: torch's variable-length flash
        attention (``torch.nn.attention.varlen.varlen_attn``: one kernel over every sequence, grouped query heads
        native; not run here, no GPU); elsewhere (CPU, the simulated device, whose torch has no CUDA kernels, and a
        CUDA torch older than varlen_attn): ``grouped_sdpa`` on each sequence in turn. cu_seqlens is a host tensor
        (``packing.Packed.to``): the lengths are read without a device sync."""
        from megatron.core.transformer.enums import AttnMaskType

        if params.qkv_format != "thd" or mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention: packed sequences take qkv_format 'thd' with a causal mask, got "
                             f"{params.qkv_format!r} and {mask_type}")
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        if params.cu_seqlens_q_padded is not None or not torch.equal(cu_q, cu_k):
            raise ValueError("SDPAttention: packed sequences need the same cu_seqlens for queries and keys, unpadded")
        v = value.contiguous()
        cuda = _cuda_kernels(query)
        varlen_attn = _varlen_attn(query) if cuda else None
        if varlen_attn is not None:
            cu_q = cu_k = cu_q.to(query.device, non_blocking=True)  # from the host (learner/packing.py), no sync
            out = varlen_attn(query, key, v, cu_q, cu_k, params.max_seqlen_q, params.max_seqlen_kv,
                              scale=self.softmax_scale, window_size=(-1, 0), enable_gqa=query.shape[1] != key.shape[1])
            return out.reshape(out.shape[0], -1)
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        parts = [grouped_sdpa(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], vv.permute(1, 0, 2)[None], mask=None,
                              causal=True, scale=self.softmax_scale, native_gqa=_native_gqa(query))[0].permute(1, 0, 2)
                 for q, k, vv in zip(query.split(lengths), key.split(lengths), v.split(lengths), strict=True)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # one sequence: the kernel's output, no copy
        return out.reshape(query.shape[0], -1)

    @staticmethod
    def _mask(mask_type, attention_mask: torch.Tensor | None, sq: int, sk: int):
        """(SDPA's attn_mask, is_causal) for Megatron's mask type (module docstring, "Masks")."""
        from megatron.core.transformer.enums import AttnMaskType

        if mask_type == AttnMaskType.causal:
            if sq != sk:
                raise ValueError(f"SDPAttention: a causal mask needs as many queries as keys (self attention without a "
                                 f"cache), got {sq} and {sk}")
            return None, True
        if mask_type == AttnMaskType.no_mask:
            return None, False
        if mask_type in (AttnMaskType.padding, AttnMaskType.arbitrary) and attention_mask is not None:
            return ~attention_mask, False
        raise ValueError(f"SDPAttention: attn_mask_type {mask_type} with attention_mask "
                         f"{'None' if attention_mask is None else 'given'} is not supported (causal, no_mask, or "
                         "padding / arbitrary with a mask)")
