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

from megatron_qarl.moe.convert import ParamMap, iter_hf_tensors, peer_expert_name
from megatron_qarl.moe.parallelize import all_gather_tensors, to_group_device
from megatron_qarl.qat.export import to_sglang_tensors


def iter_sync_tensors(learner, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the server's checkpoint format, in one fixed order (collective)."""
    fq = learner.fake_quant
    quantized = {t.pm.mcore for t in fq.targets} if fq else set()

    def high_precision(pm: ParamMap) -> bool:
        return pm.mcore not in quantized

    for name, tensor in iter_hf_tensors(learner.module, learner.arch, include=high_precision):
        yield name, tensor.to(dtype)
    if not fq:
        return
    from megatron.core import parallel_state as ps

    lay = fq.layout
    ep_group = ps.get_expert_model_parallel_group() if lay.ep > 1 else None
    n_local = learner.arch.num_experts // lay.ep
    for t in fq.targets:
        for hf_name, qw in fq.target_codes(t).items():
            tensors = to_sglang_tensors(hf_name.removesuffix(".weight"), qw)
            if t.pm.split not in ("fc1", "fc2"):
                yield from tensors.items()
                continue
            for name, tensor in tensors.items():
                peers = all_gather_tensors(to_group_device(tensor, ep_group), ep_group, lay.ep, name=name)
                for r, peer in enumerate(peers):
                    yield peer_expert_name(name, t.pm, lay, n_local, r), peer
