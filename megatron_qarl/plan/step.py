"""The planner's model of every phase of a training step (``plan.phases.PHASES``), per learner GPU.

Every phase holds the persistent state of ``memory.learner_memory`` (weights 2P, gradients 4P, the optimizer's
shard, the QAT cache) and what the phase itself allocates (``phase_transients``); the step's peak is the largest
phase. Notation as in ``memory``: T micro-batch tokens on a data-parallel rank, t = T/tp, s the sequence length,
L layers, E experts, k per token, V_pad the padded vocabulary, e = attention score elements of one layer on the
rank (``attention_score_elements``: T*s*a/tp). What each term is was traced on the simulation
(plan/simulate.py, docs/plan.md):

- unfused attention (the local spec): Megatron's DotProductAttention writes its bf16 raw scores into a global
  buffer that stays allocated from the first forward on: 2e B in every phase after it (``attention_buffer``).
  While a layer's core attention runs forward (a no-grad forward, or its recompute in the backward) it holds
  14 B per score element at once: the buffer, their fp32 copy, the fp32 softmax, the bf16 probabilities and the
  masked scores (``attention_forward_ws``).
- sdpa attention (the local spec with torch's fused attention, moe/attention.py): no score buffer, no s^2 term;
  the core attention keeps q, k, v per group, its output and an fp32 log-sum-exp per head and query; its forward
  under selective recompute (in the backward) holds its output, the log-sum-exp and V's copy:
  T/tp * (2ad + 4a + 2gd) B (``sdpa_forward_ws``). Its no-grad working set is the flash one's.
- every forward keeps, per MoE layer, the router's fp32 logits, its boolean routing map and the int64 top-k
  indices: t * (5E + 8k) B (``router_residue``), until the step's backward ends.
- a no-grad forward (log-prob, R3, evaluation) holds one layer's working set at a time: the core attention's
  (unfused) with the layer's input gathered over sequence parallelism, q, k, v and k, v repeated to every query
  head: T * (2h + 2(a + 2g)d/tp + 4ad/tp) B; with flash attention the larger of that and the experts' GEMMs.
- train_step: the larger of the end of the forward (everything saved + the logits and the cross entropy's
  softmax) and the backward's peak. selective: the last layer's core attention recomputed (14 B per score
  element); none: the backward of a layer's scores; full: the backward reaches the first chunk with every
  chunk's kept input AND the input gradient each recomputed chunk returned still referenced (2 * 2Th/tp per
  chunk), and that chunk recomputed with its attention.
- sync_sender (rank 0): the fake-quant cache was freed by the step (it refills as the payload is quantized),
  the bucket (up to ``bucket_bytes`` past its last tensor) and the all-gather of the next tensor: the larger of
  the high-precision stage (bucket + 2 x the largest high-precision tensor: TP shards + their concatenation)
  and the low-bit stage (the whole cache + bucket + the EP gather of one expert tensor's codes).
  sync_peer: the same without the bucket.
- checkpoint_save: the sharded state dicts are views of the live state (nothing allocated on the device;
  dist-checkpointing stages through host memory).
- the router residue, and under full recompute the kept inputs and input gradients of every chunk, outlive the train
  step until Python's cyclic garbage collector runs: the phases after it hold them too (``unreleased``).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.memory import (
    LearnerLayout,
    activation_bytes,
    attention_score_elements,
    flash_layer_bytes,
    learner_memory,
    local_spec_activation_parts,
    padded_vocab,
    weight_summary,
)
from megatron_qarl.plan.phases import PHASE_NAMES
from megatron_qarl.qat.config import QuantConfig

PERSISTENT = ("weights", "gradients", "optimizer", "qat_cache")
ATTENTION_FORWARD_B = 14  # bytes per score element while an unfused core attention runs forward (module doc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
    """What the phases' transients depend on beyond the layout: the micro-batch, the learner's settings and the
    weight sync's bucket."""

    tokens: int  # micro-batch tokens per data-parallel rank
    seq_len: int
    attention: str = "flash"
    distributed_optimizer: bool = True
    offload_fraction: float = 0.0
    recompute: str = "none"
    recompute_num_layers: int = 1
    expert_imbalance: float = 1.0
    bucket_bytes: int = 512 << 20


def router_residue(arch: Qwen3MoeArch, lay: LearnerLayout, tokens: int) -> float:
    """Bytes every forward keeps per MoE layer: t * (5E + 8k) (fp32 router logits, bool routing map, int64 top-k)."""
    return tokens / lay.tp * (5 * arch.num_experts + 8 * arch.num_experts_per_tok)


def attention_buffer(arch: Qwen3MoeArch, lay: LearnerLayout, sh: StepShape) -> float:
    """The unfused attention's global bf16 score buffer (2e B), allocated from the first forward on; 0 for flash and
    sdpa."""
    return 2 * attention_score_elements(arch, lay, sh.tokens, sh.seq_len) if sh.attention == "unfused" else 0.0


def sdpa_forward_ws(arch: Qwen3MoeArch, lay: LearnerLayout, tokens: int) -> float:
    """What the sdpa core attention's forward allocates beyond its inputs: T/tp * (2ad + 4a + 2gd) (its output, the
    fp32 log-sum-exp, V's contiguous copy)."""
    a, g, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    return tokens / lay.tp * (2 * a * d + 4 * a + 2 * g * d)


def nograd_layer_ws(arch: Qwen3MoeArch, lay: LearnerLayout, sh: StepShape) -> float:
    """One layer's working set in a no-grad forward (module doc), the attention buffer included."""
    h, a, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    t_all = sh.tokens
    inputs = t_all * (2 * h + 2 * (a + 2 * g) * d / lay.tp + 4 * a * d / lay.tp)
    if sh.attention in ("flash", "sdpa"):
        pairs = t_all * arch.num_experts_per_tok * lay.etp / lay.tp * sh.expert_imbalance
        experts = pairs * (2 * h + 3 * 2 * arch.moe_intermediate_size / lay.etp)
        return max(inputs, experts)
    return inputs + ATTENTION_FORWARD_B * attention_score_elements(arch, lay, sh.tokens, sh.seq_len)


def logits_ws(arch: Qwen3MoeArch, lay: LearnerLayout, tokens: int) -> float:
    """The logits and the vocab-parallel cross entropy's fp32 softmax: T * V_pad/tp * (2 + 4)."""
    return tokens * padded_vocab(arch.vocab_size, lay.tp) / lay.tp * 6


def nograd_forward(arch: Qwen3MoeArch, lay: LearnerLayout, sh: StepShape) -> dict[str, float]:
    """A no-grad forward's transients: the larger of one layer's working set and the logits, the router residue of
    every layer, the causal mask (s^2 bool, unfused)."""
    mask = sh.seq_len ** 2 if sh.attention == "unfused" else 0
    return {"activations": max(nograd_layer_ws(arch, lay, sh), logits_ws(arch, lay, sh.tokens))
            + arch.num_hidden_layers * router_residue(arch, lay, sh.tokens) + mask}


def train_activations(arch: Qwen3MoeArch, lay: LearnerLayout, sh: StepShape) -> dict[str, float]:
    """train_step's transients (module doc); flash attention is the TE estimate of ``memory.activation_bytes``."""
    if sh.attention == "flash" and sh.recompute != "full":
        return {"activations": activation_bytes(arch, lay, sh.tokens, seq_len=sh.seq_len, attention="flash",
                                                recompute=sh.recompute, expert_imbalance=sh.expert_imbalance)}
    h, n_layers = arch.hidden_size, arch.num_hidden_layers
    e = attention_score_elements(arch, lay, sh.tokens, sh.seq_len)
    buffer, logits = attention_buffer(arch, lay, sh), logits_ws(arch, lay, sh.tokens)
    kept = 2 * sh.tokens * h / lay.tp
    residue = n_layers * router_residue(arch, lay, sh.tokens)
    if sh.recompute == "full":
        chunks, n = math.ceil(n_layers / sh.recompute_num_layers), sh.recompute_num_layers
        layer = n * (flash_layer_bytes(arch, lay, sh.tokens, sh.expert_imbalance) if sh.attention == "flash" else
                     local_spec_activation_parts(arch, lay, sh.tokens, seq_len=sh.seq_len, attention=sh.attention,
                                                 expert_imbalance=sh.expert_imbalance)["layer"])
        attn_ws = ATTENTION_FORWARD_B * e if sh.attention == "unfused" else 0.0
        forward_end = chunks * kept + residue + buffer + logits
        backward = 2 * chunks * kept + residue + layer + attn_ws
        return {"activations": max(forward_end, backward) + _once(arch, lay, sh)}
    parts = local_spec_activation_parts(arch, lay, sh.tokens, seq_len=sh.seq_len, attention=sh.attention,
                                        selective=sh.recompute == "selective", expert_imbalance=sh.expert_imbalance)
    if sh.recompute == "selective":
        saved = n_layers * parts["layer"]
        backward = saved + (ATTENTION_FORWARD_B * e if sh.attention == "unfused" else
                            sdpa_forward_ws(arch, lay, sh.tokens))
    else:
        saved = n_layers * (parts["layer"] + parts["scores"])
        backward = saved + (6 * e if sh.attention == "unfused" else 0.0)
    forward_end = saved + buffer + logits
    return {"activations": max(forward_end, backward) + _once(arch, lay, sh)}


def _once(arch: Qwen3MoeArch, lay: LearnerLayout, sh: StepShape) -> float:
    """The causal mask (s^2 bool, unfused only) and the final norm / output layer input: t * (8h + 4)."""
    mask = sh.seq_len ** 2 if sh.attention == "unfused" else 0
    return mask + sh.tokens / lay.tp * (8 * arch.hidden_size + 4)


def _largest_high_precision(arch: Qwen3MoeArch, quant: QuantConfig, dtype_bytes: int = 2) -> int:
    """Bytes of the largest tensor the sync sends in high precision (the embedding or lm_head, gathered whole)."""
    s = weight_summary(arch, quant)
    per = {"embedding": s["embedding"].numel, "lm_head": s["lm_head"].numel}
    return dtype_bytes * max(per.values())


def _expert_gather(arch: Qwen3MoeArch, quant: QuantConfig, lay: LearnerLayout) -> float:
    """The EP all-gather of one expert weight's sync tensors: ep x its exported bytes (codes and scales)."""
    s = weight_summary(arch, quant)["expert"]
    per_tensor = s.bytes / max(1, arch.num_hidden_layers * arch.num_experts * 3)
    return lay.ep * per_tensor


def sync_transients(arch: Qwen3MoeArch, quant: QuantConfig, lay: LearnerLayout, sh: StepShape, qat_cache: int,
                    sender: bool) -> dict[str, float]:
    """sync_sender / sync_peer (module doc), ``qat_cache`` the full cache (0 at the sync's start): the larger of
    the high-precision stage, min(bucket_bytes, HP bytes - the largest) (rank 0's bucket before the last big
    tensor) + 2 x the largest (its TP shards and their concatenation), and the low-bit stage, the refilled cache +
    bucket_bytes (rank 0) + the EP gather of one expert tensor."""
    big = _largest_high_precision(arch, quant)
    s = weight_summary(arch, quant)
    hp_total = sum(2 * (ks.numel - ks.q_numel) for ks in s.values())
    high = (min(sh.bucket_bytes, hp_total - big) if sender else 0) + 2 * big
    low_comm = (sh.bucket_bytes if sender else 0) + _expert_gather(arch, quant, lay)
    if qat_cache and qat_cache + low_comm > high:
        return {"comm_buffers": low_comm, "qat_refill": qat_cache}
    return {"comm_buffers": high, "qat_refill": 0}


AFTER_TRAIN_STEP = ("sync_sender", "sync_peer", "checkpoint_save", "eval_forward")


def unreleased(arch: Qwen3MoeArch, lay: LearnerLayout, sh: StepShape) -> float:
    """What the train step leaves allocated until Python's cyclic garbage collector runs (the simulation shows it in
    every phase after the step): every layer's router residue, and under full recompute every chunk's kept input and
    the input gradient its recompute returned, 2 * 2Th/tp per chunk."""
    residue = arch.num_hidden_layers * router_residue(arch, lay, sh.tokens)
    if sh.recompute != "full":
        return residue
    chunks = math.ceil(arch.num_hidden_layers / sh.recompute_num_layers)
    return residue + 2 * chunks * 2 * sh.tokens * arch.hidden_size / lay.tp


def step_memory(arch: Qwen3MoeArch, quant: QuantConfig, lay: LearnerLayout, sh: StepShape,
                phases: tuple[str, ...] = PHASE_NAMES) -> dict[str, dict[str, int]]:
    """Per phase: the persistent terms, the phase's transients (``activations``, ``comm_buffers``, and for the unfused
    attention ``attention_buffer``), and ``total``, bytes per GPU."""
    mem = learner_memory(arch, quant, lay, micro_batch_tokens=sh.tokens, seq_len=sh.seq_len, attention=sh.attention,
                         distributed_optimizer=sh.distributed_optimizer, offload_fraction=sh.offload_fraction,
                         recompute=sh.recompute, recompute_num_layers=sh.recompute_num_layers,
                         expert_imbalance=sh.expert_imbalance)
    base = {k: mem[k] for k in PERSISTENT}
    buffer = attention_buffer(arch, lay, sh)
    out = {}
    for name in phases:
        terms = dict(base)
        if name in ("logprob_forward", "r3_forward", "eval_forward"):
            terms.update(nograd_forward(arch, lay, sh))
        elif name == "train_step":
            terms.update(train_activations(arch, lay, sh))
        elif name in ("sync_sender", "sync_peer"):
            sync = sync_transients(arch, quant, lay, sh, base["qat_cache"], sender=name == "sync_sender")
            terms["qat_cache"] = int(sync.pop("qat_refill"))
            terms.update(sync)
            terms["attention_buffer"] = buffer
        else:  # checkpoint_save
            terms["attention_buffer"] = buffer
        if name in AFTER_TRAIN_STEP:
            terms["unreleased"] = unreleased(arch, lay, sh)
        terms = {k: int(v) for k, v in terms.items()}
        terms["total"] = sum(terms.values())
        out[name] = terms
    return out


def peak_phase(phases: dict[str, dict[str, int]]) -> tuple[str, int]:
    """(the phase that sets the step's peak, its bytes)."""
    name = max(phases, key=lambda p: phases[p]["total"])
    return name, phases[name]["total"]
