"""What a weight sync sends: the learner's weights in the rollout server's checkpoint format.

Collective over all learner ranks (every rank iterates in step); rank 0 receives every tensor:
  - weights the quant config leaves in high precision: TP shards all-gathered, every EP rank's
    experts all-gathered, cast to the server's dtype, under Hugging Face names;
  - quantized weights: the integer codes and scales of qat/'s one quantizer, taken from the learner's
    fake-quant cache (the very call its forward used), in SGLang's format (weight_packed /
    weight_scale / weight_shape for W4A16, weight + weight_scale(_inv) for W8A8); each EP rank
    contributes its own experts' codes, all-gathered to rank 0.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_qarl.errors import UserError
from megatron_qarl.moe.convert import ParamMap, iter_hf_tensors, peer_expert_name
from megatron_qarl.moe.parallelize import all_gather_tensors, to_group_device
from megatron_qarl.qat.export import to_sglang_tensors


def check_sendable(fq, group=None) -> None:
    """UserError on every learner rank alike, before any tensor moves, when a quantized weight of any rank holds a
    nan / inf (its scales are non-finite; the codes would be garbage): every rank's finiteness flags, one per
    quantizer call, are all-gathered over the default group (one collective every rank joins) and read to the host
    once (their ``any``; the table itself only to name what was found). A refusal on the one rank that found it
    would leave the others blocked in the sync's next gather. ``group``: the world's group to gather on (the sync's
    own, ``SyncGroups.world``; None: the default group)."""
    import torch.distributed as dist

    from megatron_qarl.qat.modules import finite_flags

    flags = finite_flags(fq)
    if not flags:
        return
    bad = torch.stack([torch.logical_not(f) for _, f in flags]).to(torch.uint8)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = all_gather_tensors(to_group_device(bad, group), group, world, name="the weights' finiteness flags") \
        if world > 1 else [bad]
    table = torch.stack(rows)  # [rank][quantizer call]
    if not bool(table.any()):  # the one host read when all is well
        return
    table = table.cpu().tolist()
    found = [f"{name} on learner rank {r}" for r, row in enumerate(table) for (name, _), b in zip(flags, row,
                                                                                                strict=True) if b]
    raise UserError(f"weight sync refused on every rank: non-finite value(s) (nan/inf) in {'; '.join(found)}; "
                    "no tensor was sent, the rollout servers keep their previous weights")


def iter_sync_tensors(learner, dtype: torch.dtype = torch.bfloat16, groups=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the server's checkpoint format, in one fixed order (collective). Every rank first agrees
    that every quantized weight is finite (``check_sendable``, raised here, before the generator's first item).
    ``groups``: the groups every collective of it runs on (``parallelize.SyncGroups``, the sync's own; None:
    the default group and Megatron's)."""
    fq = learner.fake_quant
    if fq:
        check_sendable(fq, groups.world if groups else None)
    return _sync_tensors(learner, fq, dtype, groups)


def _sync_tensors(learner, fq, dtype: torch.dtype, groups) -> Iterator[tuple[str, torch.Tensor]]:
    quantized = {t.pm.mcore for t in fq.targets} if fq else set()

    def high_precision(pm: ParamMap) -> bool:
        return pm.mcore not in quantized

    for name, tensor in iter_hf_tensors(learner.module, learner.arch, include=high_precision, groups=groups):
        yield name, tensor.to(dtype)
    if not fq:
        return
    from megatron.core import parallel_state as ps

    lay = fq.layout
    ep_group = (groups.ep if groups else ps.get_expert_model_parallel_group()) if lay.ep > 1 else None
    n_local = learner.arch.num_experts // lay.ep
    shapes: dict[tuple, torch.Tensor] = {}  # W4A16's weight_shape, made once per shape and device (per stack)
    for t in fq.targets:
        for hf_name, qw in fq.target_codes(t, checked=True).items():
            shape = None
            if qw.scheme == "w4a16":
                key = (tuple(qw.shape), qw.codes.device)
                shape = shapes.get(key)
                if shape is None:
                    shape = shapes[key] = torch.tensor(qw.shape, dtype=torch.int32, device=qw.codes.device)
            tensors = to_sglang_tensors(hf_name.removesuffix(".weight"), qw, shape)
            if t.pm.split not in ("fc1", "fc2"):
                yield from tensors.items()
                continue
            for name, tensor in tensors.items():
                peers = all_gather_tensors(to_group_device(tensor, ep_group), ep_group, lay.ep, name=name)
                for r, peer in enumerate(peers):
                    yield peer_expert_name(name, t.pm, lay, n_local, r), peer
