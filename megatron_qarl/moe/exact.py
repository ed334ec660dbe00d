"""The learner's forward under ``numerics: exact``: the Megatron model's own parameters through numerics/ (the
rollout engine's serve/exact_forward.py computes with the same functions), so its log-probs equal the servers'
bit for bit, at any TP x EP layout. The backward is ordinary autograd (numerics/ops.py's references).

It replaces GPTModel.forward for the log-probs (``ExactForward.logprobs``); the parameters, DDP, the optimizer,
checkpoints and the weight sync stay Megatron's. Layout (this rank's shard of the local spec, moe/convert.py):
- every TP rank holds every token (no sequence split): embeddings, norms, residuals, the router and the loss are
  computed alike on each, their gradients whole; the parameters Megatron reduces over TP (``sequence_parallel``)
  get theirs divided by TP first, so the sum is the gradient once;
- column-parallel linears (qkv, fc1 under expert TP, the output layer) give each output whole on one rank;
- row-parallel linears (o_proj, fc2 under expert TP) return each rank's chunk partial sums (numerics CHUNK
  elements of K each), gathered over the group and added in chunk order: the full K's order at any TP;
- the vocab-parallel embedding: each token's row from the rank that holds it;
- experts under EP: tokens gathered over the expert group (TP ranks first take their share of the rows), each
  rank runs its experts, each (token, slot) output taken from the rank that owns the expert, then combined in
  expert order (numerics.ops.combine) and the rows gathered back over TP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_qarl.moe.exact_comm import (
    Group,
    copy_to,
    gather_last,
    gather_rows,
    scale_grad,
    select_owner,
    split_rows,
)
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.numerics import layers, ops

if TYPE_CHECKING:
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.kv_cache import KVCacheSpec
    from megatron_qarl.qat.modules import FakeQuant


def _groups() -> tuple[Group, Group, Group]:
    """(tensor, expert, expert-tensor) parallel groups of this rank."""
    from megatron.core import parallel_state as ps

    return (Group(ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
                  ps.get_tensor_model_parallel_rank()),
            Group(ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size(),
                  ps.get_expert_model_parallel_rank()),
            Group(ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(),
                  ps.get_expert_tensor_parallel_rank()))


def _local_expert_weights(experts: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter, int | None]]:
    """(fc1 parameter, fc2 parameter, row) of each local expert: SequentialMLP's experts' own parameters (row None),
    or the grouped experts' stacked parameters and the expert's row in them (moe/grouped.py)."""
    if hasattr(experts, "local_experts"):
        return [(e.linear_fc1.weight, e.linear_fc2.weight, None) for e in experts.local_experts]
    return [(experts.linear_fc1.weight, experts.linear_fc2.weight, e) for e in range(experts.num_local_experts)]


class ExactForward:
    """Log-probs of one rank's (unwrapped) Megatron GPTModel in exact numerics. ``act``: the servers' activation
    dtype (rollout.dtype); ``fake_quant``: the aligned learner's quantizers (their codes' dequantized weights are
    what the quantized linears multiply), None for scheme bf16."""

    def __init__(self, module: torch.nn.Module, arch: Qwen3MoeArch, act: torch.dtype,
                 fake_quant: FakeQuant | None, kv: KVCacheSpec | None = None):
        """``kv``: the servers' FP8 KV cache (qat/kv_cache.py), whose read-back keys and values the attention takes
        (None: as computed)."""
        from megatron_qarl.numerics import native

        native.lib()
        self.module, self.arch, self.act, self.fq, self.kv = module, arch, act, fake_quant, kv
        self.tp, self.ep, self.etp = _groups()
        self.cos, self.sin = ops.rope_tables(arch.max_position_embeddings, arch.head_dim, arch.rope_theta)
        cfg = fake_quant.cfg if fake_quant is not None else None
        self.scheme = cfg.scheme if cfg is not None else "bf16"
        self.group = cfg.group_size if cfg is not None else None
        # by (parameter, row): a grouped expert linear's parameter holds every expert (moe/grouped.py)
        self.targets = {(id(t.param), t.expert): t for t in fake_quant.targets} if fake_quant is not None else {}

    def invalidate(self) -> None:
        """Forget what the kernels keep derived from the parameters (``native.transposed``'s K-major copies, held
        on a parameter the forward multiplies as it is: float32 weights and activations). The learner calls it
        wherever it invalidates the fake-quant codes, after every optimizer step and weight load: the distributed
        optimizer all-gathers the parameters a rank does not own without bumping their version, so a copy keyed on
        the version alone would keep the first step's weights on that rank."""
        from megatron_qarl.numerics import native

        native.forget_transposed(self.module.parameters())

    # ------------------------------------------------------------------------------------------ operands
    def w(self, param: torch.nn.Parameter, expert: int | None = None) -> Tensor:
        """The weight a linear multiplies: the quantizer's dequantized codes (straight-through) for a quantized
        one, else the parameter rounded to the activation dtype (what the servers hold). ``expert``: the row of a
        grouped expert parameter."""
        t = self.targets.get((id(param), expert))
        if t is not None:
            return self.fq.exact_weight(t)  # type: ignore[union-attr]
        return ops.round_to((param if expert is None else param[expert]).float(), self.act)

    def shared(self, param: torch.nn.Parameter) -> Tensor:
        """A replicated parameter used alike on every TP rank (``w``); if Megatron sums its gradient over TP, each
        rank's whole gradient is divided by TP first."""
        if self.tp.size > 1 and getattr(param, "sequence_parallel", False):
            return self.w(scale_grad(param, 1.0 / self.tp.size))  # type: ignore[arg-type]
        return self.w(param)

    def _scheme_of(self, param: torch.nn.Parameter, expert: int | None = None) -> tuple[str, int | None]:
        return (self.scheme, self.group) if (id(param), expert) in self.targets else ("bf16", None)

    def _row_parallel(self, x: Tensor, param: torch.nn.Parameter, g: Group, expert: int | None = None) -> Tensor:
        """round(quant_act(x) @ W.T) of a row-parallel linear: x and W split along K over ``g``."""
        scheme, group = self._scheme_of(param, expert)
        if g.size > 1 and scheme in ("w8a8_int8", "w8a8_fp8"):  # the per-token scale wants the whole row
            with torch.no_grad():
                full = torch.cat(g.gather(x.detach(), "exact act row"), dim=-1)
                fq = ops.quant_act(full, scheme, group).chunk(g.size, dim=-1)[g.rank]
            from megatron_qarl.qat.fake_quant import straight_through

            xq = straight_through(x, fq.contiguous())
        else:
            xq = ops.quant_act(x, scheme, group)
        if g.size == 1:
            return layers.dense(xq, self.w(param, expert), self.act)
        return ops.round_to(ops.sum_chunks(gather_last(ops.linear_partials(xq, self.w(param, expert)), g)), self.act)

    def _column(self, x: Tensor, param: torch.nn.Parameter, g: Group, expert: int | None = None) -> Tensor:
        return layers.dense(ops.quant_act(copy_to(x, g), *self._scheme_of(param, expert)), self.w(param, expert),
                            self.act)

    # ------------------------------------------------------------------------------------------ the layers
    def _embed(self, tokens: Tensor) -> Tensor:
        w = self.module.embedding.word_embeddings.weight
        rows = w.shape[0]
        start = self.tp.rank * rows
        local = tokens - start
        mine = (local >= 0) & (local < rows)
        e = F.embedding(torch.where(mine, local, torch.zeros_like(local)), w)
        return ops.round_to(select_owner(e.float(), tokens // rows, self.tp), self.act)

    def _attention(self, attn: torch.nn.Module, h: Tensor, pos: Tensor, b: int, s: int, index: int) -> Tensor:
        a = self.arch
        d, rep = a.head_dim, a.num_attention_heads // a.num_key_value_heads
        qkv = self._column(h, attn.linear_qkv.weight, self.tp)
        # [T, local KV groups, rep q heads + k + v, D], split in one op: three slices would each take a zero-filled
        # gradient of the whole qkv in the backward
        q_part, k_part, v_part = qkv.view(b * s, -1, rep + 2, d).split([rep, 1, 1], dim=2)
        q, k = layers.qk_norm_rope(q_part.reshape(b * s, -1, d), k_part.squeeze(2), self.w(attn.q_layernorm.weight),
                                   self.w(attn.k_layernorm.weight), self.cos[pos], self.sin[pos], a.rms_norm_eps,
                                   self.act)
        g = q_part.shape[1]
        v = v_part.reshape(b, s, g, d)
        if self.kv is not None:  # the keys and values as the servers' FP8 cache reads them back (exact.c's too)
            k, v = self.kv.round_trip(k, index, 0), self.kv.round_trip(v, index, 1)
        o = ops.attention_causal(q.view(b, s, -1, d), k.view(b, s, g, d), v)
        return self._row_parallel(ops.round_to(o, self.act).reshape(b * s, -1), attn.linear_proj.weight, self.tp)

    def _experts(self, mlp: torch.nn.Module, n: Tensor, ids: Tensor) -> Tensor:
        """[T, k, H]: each (token, slot) through its expert where this rank holds it, zeros elsewhere."""
        local = _local_expert_weights(mlp.experts)
        first = self.ep.rank * len(local)
        chosen, at_rows, at_slots = [], [], []
        for e in torch.unique(ids).tolist():
            if first <= e < first + len(local):
                rows, slot = torch.nonzero(ids == e, as_tuple=True)
                chosen.append(local[e - first])
                at_rows.append(rows)
                at_slots.append(slot)
        outs = []
        if chosen:  # every expert's rows taken in one gather and split (one op each way in the backward)
            for (fc1, fc2, row), n_e in zip(chosen, n[torch.cat(at_rows)].split([len(r) for r in at_rows]),
                                            strict=True):
                gate, up = self._column(n_e, fc1, self.etp, row).chunk(2, dim=-1)
                h = ops.round_to(ops.silu_mul(gate, up), self.act)
                outs.append(self._row_parallel(h, fc2, self.etp, row))
        if not outs:
            # tied to n when none of this rank's experts is chosen: the backward's collectives (the rows' gather and
            # the owner's select) then run on every EP rank alike (adding 0 * x keeps every zero +0.0)
            return torch.zeros(*ids.shape, n.shape[1]) + n[:1, :1].sum() * 0
        # one scatter of every expert's rows (each (token, slot) is written once): an index_put per expert would
        # copy the whole [T, k, H] tensor once per expert, forward and backward. With every expert here (EP 1)
        # every (token, slot) is written, so the target need not be zeroed first.
        y = (torch.empty if self.ep.size == 1 else torch.zeros)(*ids.shape, n.shape[1])
        return y.index_put_((torch.cat(at_rows), torch.cat(at_slots)), torch.cat(outs))

    def _moe(self, mlp: torch.nn.Module, n: Tensor) -> Tensor:
        a = self.arch
        ids, wts, _ = layers.moe_route(n, self.shared(mlp.router.weight), a.num_experts_per_tok, a.norm_topk_prob)
        if self.ep.size == 1:
            return ops.round_to(ops.combine(wts, self._experts(mlp, n, ids)), self.act)
        n, ids, wts = split_rows(n, self.tp), split_rows(ids, self.tp), split_rows(wts, self.tp)
        n_all = gather_rows(n, self.ep, summed=True)
        ids_all = torch.cat(self.ep.gather(ids, "exact expert ids"))
        owner = ids_all // (a.num_experts // self.ep.size)
        y = select_owner(self._experts(mlp, n_all, ids_all), owner, self.ep, split=True)
        return gather_rows(ops.round_to(ops.combine(wts, y), self.act), self.tp)

    def logprobs(self, tokens_BS: Tensor, labels_BS: Tensor, temperature: float) -> Tensor:
        """log_softmax(z / T)[label] at every position: float32 [B, S], with autograd."""
        a, m, act = self.arch, self.module, self.act
        b, s = tokens_BS.shape
        pos = torch.arange(s).repeat(b)
        x = self._embed(tokens_BS.reshape(-1))
        for index, layer in enumerate(m.decoder.layers):
            h = layers.norm(x, self.shared(layer.input_layernorm.weight), a.rms_norm_eps, act)
            x = ops.round_to(x + self._attention(layer.self_attention, h, pos, b, s, index), act)
            n = layers.norm(x, self.shared(layer.pre_mlp_layernorm.weight), a.rms_norm_eps, act)
            x = ops.round_to(x + self._moe(layer.mlp, n), act)
        x = layers.norm(x, self.shared(m.decoder.final_layernorm.weight), a.rms_norm_eps, act)
        logits = gather_last(ops.linear(copy_to(x, self.tp), self.w(m.output_layer.weight)), self.tp)
        return layers.logprobs_of(logits.view(b, s, -1), labels_BS, temperature)


def exact_forward(numerics: str, learner: Any, act: torch.dtype, quant: QuantConfig | None,
                  aligned: bool) -> ExactForward | None:
    """A learner's (learner/rank.py, which imports this module) ``ExactForward`` under ``numerics: exact`` (None
    under default); ValueError naming what it cannot serve (also refused at load: preflight/rules.py
    ``check_numerics``)."""
    if numerics == "default":
        return None
    if numerics != "exact":
        raise ValueError(f"numerics: {numerics!r} is not one of default, exact")
    if learner.impl != "local" or learner.routing_replay:
        raise ValueError("numerics: exact computes Megatron's local spec (model.impl local) with its own routes (no "
                         f"routing replay); got impl {learner.impl!r}, routing_replay {learner.routing_replay}")
    if quant is not None and quant.enabled and not aligned:
        raise ValueError("numerics: exact needs learner.aligned true with a quantized scheme (the servers' low-bit "
                         "weights in the learner's forward)")
    device = next(learner.module.parameters()).device
    if device.type != "cpu":
        # a CPU config started where CUDA is visible builds its learner on the GPU (Megatron places the model on
        # the current CUDA device); the kernels would refuse only at the first forward, after the servers started
        raise ValueError(f"numerics: exact computes on the CPU (megatron_qarl/numerics/ is C), but this learner's "
                         f"parameters are on {device}: CUDA is visible to a CPU run; hide it "
                         "(CUDA_VISIBLE_DEVICES='') or run with numerics default (docs/numerics.md, 'On GPUs')")
    return ExactForward(learner.module, learner.arch, act, learner.fake_quant, learner.kv_cache)
