"""Memory planner: parameter counts, checkpoint bytes, and per-GPU memory of the learner and rollout servers.

Pure functions of a ``Qwen3MoeArch`` (and a ``QuantConfig``); nothing here touches torch tensors. Notation:
L layers, h hidden, a query heads, g KV heads, d head dim, E experts, k experts per token, F expert FFN
width, V vocab, T micro-batch tokens. Sizes are bytes; ``GIB`` = 2**30.

The rollout checkpoint is counted tensor by tensor, in the very format ``qat.export`` writes, with the
exporter's rule for what is quantized (a 2-D ``*.weight`` whose module ``is_quantized`` selects):
    unquantized     numel * 2 (BF16)
    w4a16           N*K/2 (int32-packed int4) + 2*N*K/G (bf16 scales) + 8 (int32 weight_shape)
                    (+ 4*ceil(N/8)*K/G int32-packed zero points when asymmetric)
    w8a8_fp8        N*K (e4m3) + 4*ceil(N/B)*ceil(K/B) (fp32 weight_scale_inv per BxB block)
    w8a8_int8       N*K (int8) + 4*N (fp32 per-channel weight_scale)
Qwen3-30B-A3B: 30,532,122,624 parameters -> BF16 56.87 GiB (published 56.88, -0.02%); W4A16 with the default
ignore list (attention, router, embeddings, lm_head, norms in BF16) 16.79 GiB (published 16.89, -0.6%):
13.50 GiB packed experts + 0.42 GiB bf16 group scales + 2.87 GiB BF16 rest. Only this counting comes near
16.89: packed experts + BF16 rest without scales is 16.37 GiB (-3.1%), packed experts + scales 13.92 GiB.
The remaining 0.10 GiB is one int4 zero point per group (asymmetric weight_zero_point, or AWQ/GPTQ qzeros):
with them (``symmetric=False``) the count is 16.90 GiB (+0.05%); SGLang's MoE Marlin path loads symmetric
checkpoints, which store none.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from megatron_qarl.errors import UserError
from megatron_qarl.moe.model import Qwen3MoeArch, expert_tp
from megatron_qarl.qat.config import QuantConfig, is_quantized

if TYPE_CHECKING:
    from megatron_qarl.config import QarlConfig

GIB = 2**30
KINDS = ("embedding", "lm_head", "attn_q", "attn_kv", "attn_o", "attn_bias", "qk_norm", "norm", "router", "expert")


class LayoutError(UserError):
    """A parallel layout the learner (Megatron) or a rollout server (SGLang) cannot run."""


@dataclasses.dataclass(frozen=True)
class HfTensor:
    name: str
    shape: tuple[int, ...]
    kind: str  # one of KINDS

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def hf_tensors(arch: Qwen3MoeArch) -> Iterator[HfTensor]:
    """Every tensor of the Hugging Face checkpoint (per-expert keys, as save_pretrained writes them)."""
    h, d, a, g, f = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads, \
        arch.moe_intermediate_size
    yield HfTensor("model.embed_tokens.weight", (arch.vocab_size, h), "embedding")
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}"
        yield HfTensor(f"{p}.input_layernorm.weight", (h,), "norm")
        yield HfTensor(f"{p}.post_attention_layernorm.weight", (h,), "norm")
        yield HfTensor(f"{p}.self_attn.q_proj.weight", (a * d, h), "attn_q")
        yield HfTensor(f"{p}.self_attn.k_proj.weight", (g * d, h), "attn_kv")
        yield HfTensor(f"{p}.self_attn.v_proj.weight", (g * d, h), "attn_kv")
        yield HfTensor(f"{p}.self_attn.o_proj.weight", (h, a * d), "attn_o")
        if arch.attention_bias:
            for proj, n in (("q", a * d), ("k", g * d), ("v", g * d)):
                yield HfTensor(f"{p}.self_attn.{proj}_proj.bias", (n,), "attn_bias")
        yield HfTensor(f"{p}.self_attn.q_norm.weight", (d,), "qk_norm")
        yield HfTensor(f"{p}.self_attn.k_norm.weight", (d,), "qk_norm")
        yield HfTensor(f"{p}.mlp.gate.weight", (arch.num_experts, h), "router")
        for e in range(arch.num_experts):
            yield HfTensor(f"{p}.mlp.experts.{e}.gate_proj.weight", (f, h), "expert")
            yield HfTensor(f"{p}.mlp.experts.{e}.up_proj.weight", (f, h), "expert")
            yield HfTensor(f"{p}.mlp.experts.{e}.down_proj.weight", (h, f), "expert")
    yield HfTensor("model.norm.weight", (h,), "norm")
    yield HfTensor("lm_head.weight", (arch.vocab_size, h), "lm_head")


def param_counts(arch: Qwen3MoeArch) -> dict[str, int]:
    """Parameters by part. ``attention_per_layer`` = q, k, v, o (+ biases) + q/k norms; ``active`` = what one
    token uses: everything but the E - k experts it is not routed to (embeddings included, as published)."""
    by_kind = dict.fromkeys(KINDS, 0)
    for t in hf_tensors(arch):
        by_kind[t.kind] += t.numel
    attention = sum(by_kind[k] for k in ("attn_q", "attn_kv", "attn_o", "attn_bias", "qk_norm"))
    total = sum(by_kind.values())
    inactive = by_kind["expert"] * (arch.num_experts - arch.num_experts_per_tok) // arch.num_experts
    return {
        "embedding": by_kind["embedding"], "lm_head": by_kind["lm_head"], "attention": attention,
        "attention_per_layer": attention // arch.num_hidden_layers, "router": by_kind["router"],
        "experts": by_kind["expert"], "norms": by_kind["norm"], "total": total, "active": total - inactive,
        "active_non_embedding": total - inactive - by_kind["embedding"],
    }  # fmt: skip


def stored_bytes(t: HfTensor, quant: QuantConfig, unquantized_bytes: int = 2) -> tuple[int, int]:
    """(bytes of ``t`` in the exported checkpoint, of which scales / zero points / shape), per the module doc."""
    prefix = t.name.removesuffix(".weight")
    if not (t.name.endswith(".weight") and len(t.shape) == 2 and is_quantized(prefix, quant)):
        return t.numel * unquantized_bytes, 0
    n, k = t.shape
    gs = quant.group_size
    if quant.scheme == "w4a16":
        extra = 2 * n * (k // gs) + 8 + (0 if quant.symmetric else 4 * math.ceil(n / 8) * (k // gs))
        return n * k // 2 + extra, extra
    if quant.scheme == "w8a8_fp8":
        extra = 4 * math.ceil(n / gs) * math.ceil(k / gs)
        return n * k + extra, extra
    extra = 4 * n  # w8a8_int8
    return n * k + extra, extra


@dataclasses.dataclass(frozen=True)
class KindSummary:
    numel: int = 0  # parameters
    bytes: int = 0  # exported checkpoint bytes
    q_numel: int = 0  # parameters quantized under the scheme
    q_extra: int = 0  # bytes of their scales / zero points / shapes


@functools.lru_cache(maxsize=32)
def weight_summary(arch: Qwen3MoeArch, quant: QuantConfig, unquantized_bytes: int = 2) -> dict[str, KindSummary]:
    """Per tensor kind: parameters, checkpoint bytes, quantized parameters and their scale bytes."""
    acc = {k: [0, 0, 0, 0] for k in KINDS}
    for t in hf_tensors(arch):
        nbytes, extra = stored_bytes(t, quant, unquantized_bytes)
        row = acc[t.kind]
        row[0] += t.numel
        row[1] += nbytes
        if extra:
            row[2] += t.numel
            row[3] += extra
    return {k: KindSummary(*v) for k, v in acc.items()}


def rollout_weight_bytes(arch: Qwen3MoeArch, quant: QuantConfig, unquantized_bytes: int = 2) -> int:
    """Bytes of the whole rollout checkpoint in ``quant``'s SGLang format (formulas in the module doc).

    ``unquantized_bytes``: element size of the tensors left unquantized (2 for a BF16 checkpoint; the
    exporter passes them through, so 4 for an fp32 source like the tiny test model).
    """
    return sum(s.bytes for s in weight_summary(arch, quant, unquantized_bytes).values())


# ------------------------------------------------------------------------------------------------ learner
@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerLayout:
    """Megatron layout on ``gpus`` GPUs: TP (+ sequence parallel when TP > 1), EP, ETP = 1 if EP > 1 else TP,
    PP = 1, DP = gpus / TP, expert DP = gpus / (EP * ETP)."""

    gpus: int
    tp: int = 1
    ep: int = 1

    @property
    def etp(self) -> int:
        return expert_tp(self.tp, self.ep)

    @property
    def sp(self) -> bool:
        return self.tp > 1

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def edp(self) -> int:
        return self.gpus // (self.ep * self.etp)


def check_learner_layout(arch: Qwen3MoeArch, lay: LearnerLayout) -> None:
    """Raise LayoutError unless Megatron-Core can build ``lay`` for ``arch``."""
    e, g, a = arch.num_experts, arch.num_key_value_heads, arch.num_attention_heads
    if min(lay.gpus, lay.tp, lay.ep) < 1:
        raise LayoutError(f"learner gpus={lay.gpus}, tp={lay.tp}, ep={lay.ep}: sizes must be >= 1")
    if e % lay.ep:
        raise LayoutError(f"learner ep={lay.ep} does not divide the {e} experts (each EP rank holds E/ep of them)")
    if a % lay.tp or g % lay.tp:
        raise LayoutError(f"learner tp={lay.tp} must divide the {a} query heads and the {g} KV groups (Megatron "
                          f"splits whole query groups; it cannot replicate KV heads)")
    if lay.gpus % lay.tp or lay.gpus % (lay.ep * lay.etp):
        raise LayoutError(f"learner on {lay.gpus} GPUs: the GPU count must be a multiple of tp={lay.tp} and of "
                          f"ep*etp={lay.ep * lay.etp} (expert TP is {lay.etp})")


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of ``divisible_by * tp``."""
    m = divisible_by * tp
    return -(-vocab // m) * m


def learner_local_params(arch: Qwen3MoeArch, lay: LearnerLayout) -> tuple[float, float]:
    """(dense, expert) parameters on one rank: embedding / lm_head (padded vocab) and q,k,v,o over TP;
    norms, q/k norms and router replicated; experts over EP * ETP."""
    s = weight_summary(arch, QuantConfig())
    vocab = padded_vocab(arch.vocab_size, lay.tp) / arch.vocab_size
    dense = (s["embedding"].numel + s["lm_head"].numel) * vocab / lay.tp
    dense += sum(s[k].numel for k in ("attn_q", "attn_kv", "attn_o", "attn_bias")) / lay.tp
    dense += sum(s[k].numel for k in ("qk_norm", "norm", "router"))
    return dense, s["expert"].numel / (lay.ep * lay.etp)


# the learner's attention as the planner counts it: "flash" the Transformer Engine spec (its fused attention), "sdpa"
# Megatron's local spec with torch's fused attention (moe/attention.py), "unfused" the local spec with Megatron's
# DotProductAttention
ATTENTIONS = ("flash", "sdpa", "unfused")
LOCAL_SPEC_ATTENTIONS = ("sdpa", "unfused")
RECOMPUTES = ("none", "selective", "full")


def attention_score_elements(arch: Qwen3MoeArch, lay: LearnerLayout, tokens: int, seq_len: int) -> float:
    """Elements of one layer's attention scores on a rank: (tokens / seq_len) sequences x a/TP heads x seq_len^2
    (the query heads split over TP; every head sees the whole sequence, sequence parallel or not)."""
    return tokens * seq_len * arch.num_attention_heads / lay.tp


def local_spec_activation_parts(arch: Qwen3MoeArch, lay: LearnerLayout, tokens: int, *, seq_len: int,
                                selective: bool = False, expert_imbalance: float = 1.0,
                                attention: str = "unfused") -> dict[str, float]:
    """Bytes Megatron's local spec (the learner's ``moe.model.layer_spec``: our fp32 RMSNorm, the core attention
    ``attention``, the MoE tokens permuted by moe/dispatch.py's sort, SequentialMLP or moe/grouped.py's GroupedExperts,
    which save the same per (token, expert) pair) saves for the backward of ``tokens`` tokens in sequences of
    ``seq_len``, BF16, by part; what tests/test_plan.py measures with torch's saved-tensor hooks on the same code. Per
    token, with t = T/tp the rank's tokens under sequence parallelism and heads split over TP:
      layer    t * (2 * (6h + 4) + 2h + 2h)  input / pre-MLP norms (fp32 copy, bf16 output, fp32 1/rms), qkv and
                                             router inputs
               + T/tp * ((a + g)(6d + 4)     q / k norms, per head
                         + core              the core attention's inputs as it keeps them:
                                             unfused (DotProductAttention) 6ad: q, and k, v repeated to every query
                                             head (GQA); sdpa (torch's fused attention, moe/attention.py)
                                             2(a + 2g)d + 4a: q, k, v per group (v its own copy) and the fp32
                                             log-sum-exp per head; selective recompute, either: 2(2a+3g)d, its
                                             checkpointed inputs q, k, v (v a view of the fused qkv output,
                                             2(a+2g)d) and the roped q, k
                         + 2ad)              output projection input (sdpa: also the kernel's saved output, one
                                             storage: the flash kernels, CPU and CUDA, write it in the query's
                                             layout, [s, b, np, hn], so [s, b, np * hn] is a view of it)
               + seq_len * 8d                rotary cos / sin of q and k (per position, whole sequence on every rank)
               + t * 28k                     top-k ids and probabilities (12k), the sort's token order and its index
                                             into the probabilities (int64 each: 16k)
               + pairs * 16                  the rows' sort by local expert and its inverse (int64), where rows come
                                             from several ranks (etp * ep > 1) for several local experts
               + 4 * E / ep                  the grouped experts' offsets (int32; model.experts grouped)
               + pairs * (2h + 12F/etp + 4)  per (token, expert) pair: expert input, fc1 / SwiGLU outputs, weight
    "scores": 6 B per score element (unfused: fp32 softmax + bf16 probabilities; 0 under selective recompute, 0 for
    sdpa); "mask": the boolean causal mask, seq_len^2 B once (unfused; the sdpa learner passes none); "final":
    t * (6h + 4 + 2h) (final norm, output layer input)."""
    if attention not in LOCAL_SPEC_ATTENTIONS:
        raise ValueError(f"attention: {attention!r} is not one of the local spec's {', '.join(LOCAL_SPEC_ATTENTIONS)}")
    h, a, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    e, k, f = arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size
    t = tokens / lay.tp
    pairs = tokens * k * lay.etp / lay.tp * expert_imbalance
    unfused = attention == "unfused"
    core = 2 * (2 * a + 3 * g) * d if selective else 6 * a * d if unfused else 2 * (a + 2 * g) * d + 4 * a
    resort = 16 * pairs if lay.etp * lay.ep > 1 and e // lay.ep > 1 else 0
    layer = (t * (2 * (6 * h + 4) + 4 * h) + tokens / lay.tp * ((a + g) * (6 * d + 4) + core + 2 * a * d)
             + seq_len * 8 * d + t * 28 * k + resort + 4 * e / lay.ep + pairs * (2 * h + 12 * f / lay.etp + 4))
    scores = 6 * attention_score_elements(arch, lay, tokens, seq_len) if unfused and not selective else 0
    return {"layer": layer, "scores": scores, "mask": seq_len**2 if unfused else 0, "final": t * (8 * h + 4)}


def flash_layer_bytes(arch: Qwen3MoeArch, lay: LearnerLayout, tokens: int, expert_imbalance: float = 1.0) -> float:
    """One layer's saved activations on the TE spec (``activation_bytes``' flash estimate): 2 B per element of
    attention 2h + (a+2g)d + (a+g)d + a*d + 2a, router 2h + 2E (per token, over TP) and 2h + 3F/etp per (token,
    expert) pair, T*k*etp/tp * expert_imbalance pairs per rank."""
    h, a, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    attn = (2 * h + (a + 2 * g) * d + (a + g) * d + a * d + 2 * a) * tokens / lay.tp
    router = (2 * h + 2 * arch.num_experts) * tokens / lay.tp
    pairs = tokens * arch.num_experts_per_tok * lay.etp / lay.tp * expert_imbalance
    experts = pairs * (2 * h + 3 * arch.moe_intermediate_size / lay.etp)
    return 2 * (attn + router + experts)


def activation_bytes(arch: Qwen3MoeArch, lay: LearnerLayout, tokens: int, *, seq_len: int | None = None,
                     attention: str = "flash", recompute: str = "none", recompute_num_layers: int = 1,
                     expert_imbalance: float = 1.0) -> int:
    """Activation bytes one rank holds at the peak of a micro-batch's forward/backward: ``tokens`` tokens in
    sequences of ``seq_len`` (None: one sequence of ``tokens``), BF16.

    ``attention`` ``flash``: the TE spec (Transformer Engine's fused norms + linears, flash attention), an estimate
    after Korthikanti et al. 2022 (per layer s*b*h*(34 + 5*a*s/h)/tp with TP + SP), recounted for Qwen3-MoE: no
    dropout masks, GQA, top-k experts, flash attention keeping no s^2 scores, only its fp32 log-sum-exp. Elements
    per token and layer, each over TP (sequence parallel splits the hidden-size ones):
      attention  2h (norm input, qkv input) + (a+2g)d (q,k,v) + (a+g)d (normed, roped q,k) + a*d (output) + 2a
      moe        2h (norm input, router input) + 2E (fp32 router logits)
                 + per (token, expert) pair 2h + 3F/etp (expert input, fc1 output, swiglu output, fc2 output);
                 pairs per rank = T*k*etp/tp * expert_imbalance (balanced routing = 1.0)
    "layer" = 2 * elements; no score bytes.

    ``unfused``: the local spec (DotProductAttention: baddbmm + softmax in fp32 + bmm), counted as that code saves
    it (``local_spec_activation_parts``, measured in tests/test_plan.py): "layer", "scores" (6 B per score
    element), the mask and the final norm; while a layer runs, its bf16 raw scores and their fp32 copy add 6 B
    per score element more ("work", transient, one layer at a time). ``sdpa``: the local spec with torch's fused
    attention (moe/attention.py): the same parts with the flash attention's core (no scores, no mask, no work).

    Both: logits T*V_pad/tp * (2 + 4) (bf16 logits + the fp32 softmax the vocab-parallel cross entropy keeps).
    ``recompute`` (Megatron's activation recompute):
      none       L * (layer + scores) + work + logits
      selective  core attention recomputed (recompute_modules ["core_attn"]): L * layer (its checkpointed inputs
                 instead of the core attention's tensors) + the one layer whose attention is being recomputed
                 (scores + work) + logits
      full       uniform chunks of N = ``recompute_num_layers`` layers keep their input, 2*T*h/tp each:
                 ceil(L/N) * 2*T*h/tp + N * (layer + scores) + work + logits (the chunk being recomputed)
    Not counted: gradients in flight and dispatcher buffers (transient; see the planner's reserve).
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention: {attention!r} is not one of {', '.join(ATTENTIONS)}")
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute: {recompute!r} is not one of {', '.join(RECOMPUTES)}")
    h = arch.hidden_size
    seq_len = seq_len or tokens
    logits = tokens * padded_vocab(arch.vocab_size, lay.tp) / lay.tp * 6
    if attention == "flash":
        layer = flash_layer_bytes(arch, lay, tokens, expert_imbalance)
        layer_selective, scores, once = layer, 0.0, 0.0
    else:
        parts = local_spec_activation_parts(arch, lay, tokens, seq_len=seq_len, expert_imbalance=expert_imbalance,
                                            attention=attention)
        layer, scores, once = parts["layer"], parts["scores"], parts["mask"] + parts["final"]
        layer_selective = local_spec_activation_parts(arch, lay, tokens, seq_len=seq_len, selective=True,
                                                      expert_imbalance=expert_imbalance, attention=attention)["layer"]
    work = scores
    n_layers = arch.num_hidden_layers
    if recompute == "full":
        n = recompute_num_layers
        total = math.ceil(n_layers / n) * 2 * tokens * h / lay.tp + n * (layer + scores) + work
    elif recompute == "selective":
        total = n_layers * layer_selective + (layer - layer_selective) + scores + work
    else:
        total = n_layers * (layer + scores) + work
    return int(total + once + logits)


def qat_cache_bytes(arch: Qwen3MoeArch, quant: QuantConfig, lay: LearnerLayout) -> int:
    """The fake-quant cache of one rank (qat.modules.FakeQuant): per quantized weight the dequantized BF16
    local shard (2 B/param local) + the codes (1 B/param) and scales of the whole HF tensor, which it
    all-gathers before quantizing: for experts the rank's own E/ep experts, for attention every head."""
    if not quant.enabled:
        return 0
    s = weight_summary(arch, quant)
    total = 0.0
    for kind, ks in s.items():
        if not ks.q_numel:
            continue
        local = 1 / (lay.ep * lay.etp) if kind == "expert" else (1 if kind in ("qk_norm", "norm", "router")
                                                                  else 1 / lay.tp)
        touched = 1 / lay.ep if kind == "expert" else 1
        total += 2 * ks.q_numel * local + (ks.q_numel + ks.q_extra) * touched
    return int(total)


def optimizer_shard_params(arch: Qwen3MoeArch, lay: LearnerLayout, *, distributed_optimizer: bool = True) -> float:
    """Parameters whose fp32 master copy and Adam moments one rank keeps: its local P, or with the distributed
    optimizer P_dense / DP + P_expert / expert-DP."""
    dense, expert = learner_local_params(arch, lay)
    return dense / lay.dp + expert / lay.edp if distributed_optimizer else dense + expert


def learner_memory(arch: Qwen3MoeArch, quant: QuantConfig, lay: LearnerLayout, *, micro_batch_tokens: int,
                   seq_len: int | None = None, attention: str = "flash", distributed_optimizer: bool = True,
                   offload_fraction: float = 0.0, recompute: str = "none", recompute_num_layers: int = 1,
                   expert_imbalance: float = 1.0) -> dict[str, int]:
    """GPU bytes per rank of the Megatron learner (bf16 params, fp32 grads and Adam), by part, with ``total``.

    P = local params (``learner_local_params``):  weights 2P; gradients 4P (Megatron DDP main_grad buffer,
    grad_reduce_in_fp32, full size even with the distributed optimizer); optimizer 12 B (fp32 master, m, v) per
    ``optimizer_shard_params``, of which ``offload_fraction`` lives on the host with optimizer CPU offload
    (``optimizer_host_bytes``; the precision-aware distributed optimizer keeps no GPU master copy of it);
    activations (``activation_bytes``); qat_cache (``qat_cache_bytes``).
    """
    check_learner_layout(arch, lay)
    if offload_fraction and not distributed_optimizer:
        raise ValueError("offload_fraction: optimizer CPU offload needs the distributed optimizer")
    dense, expert = learner_local_params(arch, lay)
    shard = optimizer_shard_params(arch, lay, distributed_optimizer=distributed_optimizer)
    out = {
        "weights": int(2 * (dense + expert)),
        "gradients": int(4 * (dense + expert)),
        "optimizer": int(12 * shard * (1 - offload_fraction)),
        "activations": activation_bytes(arch, lay, micro_batch_tokens, seq_len=seq_len, attention=attention,
                                        recompute=recompute, recompute_num_layers=recompute_num_layers,
                                        expert_imbalance=expert_imbalance),
        "qat_cache": qat_cache_bytes(arch, quant, lay),
    }
    out["total"] = sum(out.values())
    return out


def optimizer_host_bytes(arch: Qwen3MoeArch, lay: LearnerLayout, offload_fraction: float) -> int:
    """Host bytes per rank of optimizer CPU offload (Megatron's HybridDeviceOptimizer): for the offloaded
    ``offload_fraction`` of the shard, the fp32 master copy, Adam's m and v, and the pinned fp32 gradient copy
    it steps from: 16 B per parameter."""
    return int(16 * optimizer_shard_params(arch, lay) * offload_fraction)


# ------------------------------------------------------------------------------------------------ rollout
@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerLayout:
    """One SGLang server on ``tp`` GPUs: attention over TP, experts over EP x MoE-TP (moe_tp = tp / ep)."""

    tp: int = 1
    ep: int = 1

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep


def check_server_layout(arch: Qwen3MoeArch, quant: QuantConfig, srv: ServerLayout) -> None:
    """Raise LayoutError unless SGLang can serve ``arch`` in ``quant`` with ``srv``."""
    e, a = arch.num_experts, arch.num_attention_heads
    if min(srv.tp, srv.ep) < 1 or srv.tp % srv.ep:
        raise LayoutError(f"rollout tp={srv.tp}, ep={srv.ep}: ep must divide tp (SGLang: moe_tp = tp / ep)")
    if e % srv.ep:
        raise LayoutError(f"rollout ep={srv.ep} does not divide the {e} experts")
    if a % srv.tp:
        raise LayoutError(f"rollout tp={srv.tp} does not divide the {a} attention heads")
    if quant.scheme == "w8a8_fp8":  # SGLang's block FP8 linear (sglang/srt/layers/quantization/fp8.py)
        b = quant.group_size
        q, kv = arch.num_attention_heads // srv.tp * arch.head_dim, kv_heads_per_gpu(arch, srv.tp) * arch.head_dim
        if q % b or kv % b:  # the fused qkv_proj: every output partition a multiple of block_n
            raise LayoutError(f"rollout tp={srv.tp}: the attention's q / k / v widths per GPU {q} / {kv} / {kv} "
                              f"are not multiples of the w8a8_fp8 block {b} (SGLang's fused qkv_proj needs them)")
        if srv.tp > 1 and q % b:  # o_proj, row parallel: its input partition a multiple of block_k
            raise LayoutError(f"rollout tp={srv.tp}: o_proj's input per GPU {q} is not a multiple of the block {b}")
    f_local = arch.moe_intermediate_size // srv.moe_tp
    if arch.moe_intermediate_size % srv.moe_tp or (
            quant.scheme in ("w4a16", "w8a8_fp8") and weight_summary(arch, quant)["expert"].q_numel
            and f_local % quant.group_size):
        raise LayoutError(f"rollout moe_tp={srv.moe_tp}: expert width {arch.moe_intermediate_size}/{srv.moe_tp} is "
                          f"not a multiple of the {quant.scheme} group/block {quant.group_size}")


def kv_heads_per_gpu(arch: Qwen3MoeArch, tp: int) -> int:
    """KV heads on one GPU: split over TP while tp <= g, one (replicated) head beyond."""
    return max(1, arch.num_key_value_heads // tp)


def kv_bytes_per_token(arch: Qwen3MoeArch, tp: int, kv_bytes: int = 2) -> int:
    """KV cache per token on one GPU: 2 (K, V) * L * kv_heads_per_gpu * d * kv_bytes (BF16 KV: 2)."""
    return 2 * arch.num_hidden_layers * kv_heads_per_gpu(arch, tp) * arch.head_dim * kv_bytes


def rollout_gpu_weight_bytes(arch: Qwen3MoeArch, quant: QuantConfig, srv: ServerLayout) -> int:
    """Checkpoint bytes held by one GPU of the server: experts / tp (E/ep experts, each split over moe_tp),
    q and o / tp, k and v * kv_heads_per_gpu / g, embedding and lm_head / tp, norms and router whole."""
    s = weight_summary(arch, quant)
    kv = kv_heads_per_gpu(arch, srv.tp) / arch.num_key_value_heads
    split = {"embedding": 1 / srv.tp, "lm_head": 1 / srv.tp, "attn_q": 1 / srv.tp, "attn_o": 1 / srv.tp,
             "attn_kv": kv, "attn_bias": 1 / srv.tp, "expert": 1 / srv.tp}
    return int(sum(ks.bytes * split.get(kind, 1.0) for kind, ks in s.items()))


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    weights: int  # per GPU
    overhead: int  # (1 - mem_fraction_static) * GPU: activations, CUDA graphs, context
    kv_pool: int  # mem_fraction_static * GPU - weights
    kv_tokens: int  # tokens of KV the pool holds
    kv_needed: int  # bytes to keep every concurrent sequence of this server at full length
    seqs_at_full_length: int  # full-length sequences the pool holds

    @property
    def fits(self) -> bool:
        """Weights leave room for at least one full-length sequence (else SGLang refuses to start)."""
        return self.seqs_at_full_length >= 1

    @property
    def fits_all(self) -> bool:
        """Every concurrent sequence can stay resident at full length (no retraction / queueing)."""
        return self.kv_pool >= self.kv_needed


def rollout_memory(arch: Qwen3MoeArch, quant: QuantConfig, srv: ServerLayout, *, gpu_bytes: int,
                   mem_fraction_static: float, concurrent_seqs: int, seq_len: int,
                   kv_cache_dtype: str = "auto") -> RolloutMemory:
    """SGLang's memory model per GPU: weights + KV pool = mem_fraction_static * GPU; the rest is overhead.

    kv_tokens = (f * GPU - weights) / kv_bytes_per_token; ``concurrent_seqs`` sequences of this server at
    ``seq_len`` tokens (prompt + max response) need concurrent_seqs * seq_len * kv_bytes_per_token, with one byte
    per element in an FP8 cache (``kv_cache_dtype``, rollout.kv_cache_dtype: SGLang's pool stores uint8, its
    MHATokenToKVPool ``store_dtype``), two in BF16 (auto): an FP8 cache holds twice the tokens of the same pool.
    """
    from megatron_qarl.qat.kv_cache import bytes_per_element

    check_server_layout(arch, quant, srv)
    weights = rollout_gpu_weight_bytes(arch, quant, srv)
    per_token = kv_bytes_per_token(arch, srv.tp, bytes_per_element(kv_cache_dtype, 2))
    pool = int(mem_fraction_static * gpu_bytes) - weights
    tokens = max(pool, 0) // per_token
    return RolloutMemory(weights=weights, overhead=int((1 - mem_fraction_static) * gpu_bytes), kv_pool=pool,
                         kv_tokens=tokens, kv_needed=concurrent_seqs * seq_len * per_token,
                         seqs_at_full_length=tokens // seq_len)


def step_shape(cfg: QarlConfig) -> tuple[int, int]:
    """(responses per step, tokens of a full-length sequence: longest prompt + max new tokens)."""
    s = cfg.rollout.sampling
    return cfg.train.prompts_per_step * s.n_samples, cfg.data.max_prompt_tokens + s.max_new_tokens


def micro_batch_sequences(cfg: QarlConfig, dp: int) -> int:
    """Sequences of one learner forward/backward on a data-parallel rank of ``dp``: learner.micro_batch_size, at
    most the rank's share of the step (None: the whole share at once)."""
    share = math.ceil(step_shape(cfg)[0] / dp)
    return min(cfg.learner.micro_batch_size or share, share)
