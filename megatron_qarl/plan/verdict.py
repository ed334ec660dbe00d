"""A learner layout's verdict for a run config: every phase of its training step (``plan.step``), the phase that
sets the peak, the GPU's itemised fixed costs (``plan.fixed_costs``) and the margin left on the GPU:

    margin = GPU memory - (the peak phase's bytes + the fixed costs)        fits when margin >= 0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.fixed_costs import fixed_costs
from megatron_qarl.plan.memory import GIB, LearnerLayout
from megatron_qarl.plan.phases import phases_of
from megatron_qarl.plan.step import StepShape, peak_phase, step_memory

if TYPE_CHECKING:
    from megatron_qarl.config import QarlConfig


def step_shape_of(cfg: QarlConfig, tokens: int, seq_len: int, settings) -> StepShape:
    """The ``StepShape`` of ``cfg`` with the learner's memory settings (``cli.LearnerSettings``)."""
    return StepShape(tokens=tokens, seq_len=seq_len, attention=settings.attention,
                     distributed_optimizer=settings.distributed_optimizer,
                     offload_fraction=settings.offload_fraction, recompute=settings.recompute,
                     recompute_num_layers=settings.recompute_num_layers,
                     bucket_bytes=cfg.rollout.sync.bucket_mb << 20)


def verdict(cfg: QarlConfig, arch: Qwen3MoeArch, lay: LearnerLayout, shape: StepShape, gpu_gib: float,
            expert_imbalance: float = 1.0) -> dict:
    """Per phase (GiB by term), the peak phase, the fixed costs, the margin and whether the layout fits."""
    import dataclasses

    shape = dataclasses.replace(shape, expert_imbalance=expert_imbalance)
    phases = step_memory(arch, cfg.quant, lay, shape, tuple(p.name for p in phases_of(cfg)))
    peak_name, peak = peak_phase(phases)
    fixed = fixed_costs(lay, layers=arch.num_hidden_layers, te=shape.attention == "flash")
    margin = gpu_gib * GIB - peak - fixed["total"]
    return {"phases_gib": {p: {k: round(v / GIB, 2) for k, v in terms.items()} for p, terms in phases.items()},
            "peak_phase": peak_name, "peak_gib": round(peak / GIB, 2),
            "fixed_gib": {k: round(v / GIB, 3) for k, v in fixed.items()},
            "margin_gib": round(margin / GIB, 2), "fits": margin >= 0}
