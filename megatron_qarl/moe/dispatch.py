"""The MoE token permutation without host reads: Megatron's token dispatchers with the permutation done by a sort.

Megatron-Core 0.16.1's unfused ``permute`` (moe_utils.py, used when ``moe_permute_fusion`` is off, which needs
Transformer Engine) builds the order of the routed tokens with two ``masked_select`` calls whose output size depends
on the data (a host read each, per layer and pass on a GPU); the alltoall dispatcher then copies the token counts to
the host (``_maybe_dtoh_and_synchronize``) and sorts the chunks of its second permutation with
``split_sizes.tolist()`` (``sort_chunks_by_idxs``). Here, for a layer's T tokens routed to k experts each (dropless,
so exactly T * k slots, a size known on the host):

    order     = argsort(routing_map^T flattened, descending, stable)[: T * k]     (slot -> flat [expert, token])
    token     = order mod T,  expert = order div T                               (expert-major, token order within)
    probs_s   = probs^T flattened [order]

which is ``masked_select``'s order exactly (expert-major, then token index), so the permuted tokens, their probs and
the un-permutation (Megatron's ``unpermute``, a scatter-add by ``token``) are bit for bit Megatron's. The counts per
expert stay on the device (``routing_map.sum(0)``): the grouped experts (moe/grouped.py) take them as their offsets.
The second permutation (rows received from each rank, grouped by local expert) is a stable sort of each row's local
expert (``repeat_interleave`` with the row count given), again Megatron's order.

What still reads the host, per layer and pass: at EP > 1 the all-to-all's split sizes (one copy of input, output and
TP splits together; the all-gather dispatcher's count of the rows this rank's experts get). At EP 1 nothing: the
all-to-all is skipped and the expert-TP gathers are of equal parts (sequence parallel splits the tokens evenly).

``sort_dispatch(model)`` gives a model's MoE layers these dispatchers (moe/model.py ``build_model``, local spec).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from torch import Tensor


def sort_by_expert(routing_map: Tensor, probs: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """(token index of each slot, its prob), slots ordered by expert then token: ``masked_select``'s order over
    ``routing_map^T`` (module docstring). ``slots``: the number of True entries (T * k dropless), known on the host."""
    tokens = routing_map.shape[0]
    # the map must hold exactly ``slots`` routes (a token routed twice to one expert, by replayed routes, would leave
    # fewer): checked on the device, no host read; a wrong count would hand the experts unrouted rows
    torch._assert_async(routing_map.sum() == slots, "MoE routing map: not the expected number of routes")
    # cloned: the slice would keep the whole [E * T] argsort alive, saved for the backward of the probs' gather
    order = torch.argsort(routing_map.T.reshape(-1).to(torch.int8), descending=True, stable=True)[:slots].clone()
    return order % tokens, probs.T.reshape(-1).index_select(0, order)


def sort_rows_by_expert(chunk_sizes: Tensor, rows: int) -> Tensor:
    """The permutation that groups rows laid out as chunks [source rank][local expert] (sizes ``chunk_sizes``,
    [ranks, local experts], on the device) by local expert, each expert's rows in source-rank order: Megatron's
    ``sort_chunks_by_idxs`` with ``sort_input_by_local_experts``, as one gather index. ``rows``: their total."""
    ranks, experts = chunk_sizes.shape
    expert_of_chunk = torch.arange(experts, device=chunk_sizes.device).repeat(ranks)
    expert_of_row = torch.repeat_interleave(expert_of_chunk, chunk_sizes.reshape(-1), output_size=rows)
    return torch.argsort(expert_of_row, stable=True)


class SortedAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's alltoall dispatcher (``moe_token_dispatcher_type="alltoall"``) with the permutations of this module:
    the same collectives, the same rows in the same order."""

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor):
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_states.shape
        # Megatron's metadata, on the device: counts per expert, the split sizes, the counts per (rank, local expert)
        self.local_counts = self.preprocess(routing_map)
        self.splits = None
        if self.ep_size > 1:  # the one host read per layer and pass: every split size the collectives need
            sizes = [self.input_splits, self.output_splits, self.output_splits_tp]
            flat = torch.cat([s.reshape(-1) for s in sizes]).tolist()
            ep, tp = self.ep_size, self.tp_size
            self.splits = (flat[:ep], flat[ep:2 * ep], flat[2 * ep:2 * ep + tp])
        slots = routing_map.shape[0] * self.config.moe_router_topk
        self.reversed_local_input_permutation_mapping, permuted_probs = sort_by_expert(routing_map, probs, slots)
        permuted = hidden_states.index_select(0, self.reversed_local_input_permutation_mapping)
        return permuted, permuted_probs

    def token_dispatch(self, permutated_local_input_tokens: Tensor, permuted_probs: Tensor):
        if self.splits is None:  # EP 1: every token stays on this rank
            return permutated_local_input_tokens, permuted_probs
        inputs, outputs, _ = self.splits
        return (all_to_all(self.ep_group, permutated_local_input_tokens, outputs, inputs),
                all_to_all(self.ep_group, permuted_probs, outputs, inputs))

    def dispatch_postprocess(self, global_input_tokens: Tensor, global_probs: Tensor):
        if self.tp_size > 1:  # EP 1: each TP rank's equal share (None: equal parts)
            sizes = None if self.splits is None else self.splits[2]
            global_input_tokens = gather_from_sequence_parallel_region(global_input_tokens, group=self.tp_group,
                                                                       output_split_sizes=sizes)
            global_probs = gather_from_sequence_parallel_region(global_probs, group=self.tp_group,
                                                                output_split_sizes=sizes)
        self.by_expert = None
        if self.num_local_experts > 1 and self.tp_size * self.ep_size > 1:
            self.by_expert = sort_rows_by_expert(self.num_global_tokens_per_local_expert,
                                                 global_input_tokens.shape[0])
            global_input_tokens = global_input_tokens.index_select(0, self.by_expert)
            global_probs = global_probs.index_select(0, self.by_expert)
        return global_input_tokens, self.local_counts, global_probs

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        if self.by_expert is not None:  # back to [source rank][local expert]: the inverse gather
            hidden_states = hidden_states.index_select(0, torch.argsort(self.by_expert))
        if self.tp_size > 1:
            sizes = None if self.splits is None else self.splits[2]
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.probs.dtype), group=self.tp_group, input_split_sizes=sizes
            ).to(hidden_states.dtype)
        return hidden_states

    def token_combine(self, hidden_states: Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        if self.splits is None:
            return hidden_states
        inputs, outputs, _ = self.splits
        return all_to_all(self.ep_group, hidden_states, inputs, outputs)


class SortedAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's all-gather dispatcher (``moe_token_dispatcher_type="allgather"``) with the permutation of this
    module. At EP > 1 the rows this rank's experts get are counted on the host (one read per layer and pass)."""

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor):
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0).long()
        slots = (self.local_map.shape[0] * self.router_topk if self.ep_size == 1 else
                 int(tokens_per_expert.sum()))
        self.reversed_local_input_permutation_mapping, self.local_probs = sort_by_expert(self.local_map, local_probs,
                                                                                         slots)
        self.routing_map = None
        permuted = hidden_states.index_select(0, self.reversed_local_input_permutation_mapping)
        return permuted, tokens_per_expert, self.local_probs


def sort_dispatch(model: torch.nn.Module) -> None:
    """Make every MoE layer of ``model`` permute by a sort: its Megatron token dispatcher becomes this module's
    subclass of the same kind, whose state (groups, expert indices, config) it keeps as constructed. (A subclass of
    MoELayer in the layer spec would do the same, but Megatron's TransformerLayer passes the process groups only to
    the MoELayer class itself, by identity.)"""
    kinds = {MoEAlltoAllTokenDispatcher: SortedAlltoAllDispatcher,
             MoEAllGatherTokenDispatcher: SortedAllGatherDispatcher}
    config = getattr(model, "config", None)
    # what the sort assumes: dropless routing, exactly top-k experts per token, no padding, no fused permutation
    taken = {"moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
             "moe_router_padding_for_quantization": False, "moe_permute_fusion": False,
             "moe_shared_expert_overlap": False}
    for key, value in taken.items():
        if config is not None and getattr(config, key, value) != value:
            raise ValueError(f"moe/dispatch.py: the sorted permutation assumes {key}={value!r}, the model has "
                             f"{getattr(config, key)!r}")
    for module in model.modules():
        if isinstance(module, MoELayer):
            kind = kinds.get(type(module.token_dispatcher))
            if kind is None:
                raise ValueError(f"parallel.dispatcher: {type(module.token_dispatcher).__name__} has no sorted "
                                 f"permutation here (alltoall and allgather do)")
            module.token_dispatcher.__class__ = kind
