"""The planner meets a real GPU: ``plan.simulate``'s phases run on the CUDA device, each phase's peak read from
torch's allocator, beside the simulation's and the plan's for the same config (benchmarks/gpu_learner.py --plan).

``one_gpu(cfg)`` cuts a run config to a one-GPU learner layout (TP 1, EP 1, no sequence parallel: a Qwen3-30B-A3B
config cut to 2 or 4 layers fits one H200); ``measure_phases(cfg, layers=L)`` builds the learner ``qarl train``
would (``plan.simulate._build_learner``), runs its first train step on the batch the simulation uses, then each
phase of ``plan.phases`` the config runs, with ``torch.cuda.reset_peak_memory_stats`` before and
``max_memory_allocated`` / ``max_memory_reserved`` after each (the allocator's peak over the phase: what lives
through it, the persistent state included, as the simulation's ``total``). ``compare`` sets beside them the
simulation's total (``simulate_learner`` at the same L, run where the GPUs are hidden: it needs the simulated
device) and the planner's (``plan.step.step_memory`` of the model cut to L layers, with the local spec's attention
that runs: ``plan.layouts.local_spec_attention``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_qarl.config import QarlConfig
from megatron_qarl.plan.phases import PHASE_NAMES, phases_of
from megatron_qarl.plan.tracker import AllocationTracker


def one_gpu(cfg: QarlConfig) -> QarlConfig:
    """``cfg`` with a one-GPU learner: TP 1, EP 1, world size 1, sequence parallel off (the rest as configured)."""
    parallel = cfg.parallel.model_copy(update={"tp": 1, "ep": 1, "world_size": 1, "sequence_parallel": False})
    return cfg.model_copy(update={"parallel": parallel})


def measure_phases(cfg: QarlConfig, *, layers: int, phases: tuple[str, ...] | None = None) -> dict:
    """Per phase (``plan.phases`` order), the CUDA allocator's peak bytes allocated and reserved, on this process's
    current CUDA device, for ``cfg`` (a one-GPU layout, ``one_gpu``) with ``layers`` layers. Joins a world of one
    rank (NCCL) unless this process has joined one (on the simulated device, gloo: its callers join first), and
    leaves it."""
    from megatron_qarl.learner.rank import policy_loss_fn
    from megatron_qarl.moe.parallelize import destroy_parallel, init_parallel, single_rank_env
    from megatron_qarl.plan.memory import micro_batch_sequences, step_shape
    from megatron_qarl.plan.simulate import _arch, _batch, _build_learner, _phase_runs

    if cfg.world_size != 1:
        raise ValueError(f"parallel.world_size: {cfg.world_size}; measure_phases runs a one-GPU layout (one_gpu)")
    if not torch.cuda.is_available():
        raise RuntimeError("measure_phases: no CUDA device (the simulation is plan.simulate's)")
    arch = _arch(cfg, layers)
    wanted = [p.name for p in phases_of(cfg)] if phases is None else [p for p in PHASE_NAMES if p in phases]
    if not dist.is_initialized():
        single_rank_env()
    init_parallel(tp=1, ep=1, seed=cfg.seed)
    out: dict[str, dict[str, int]] = {}
    try:
        micro = micro_batch_sequences(cfg, 1)
        learner = _build_learner(cfg, arch, micro, real_device=torch.version.cuda is not None)
        batch = _batch(cfg, 1, micro, step_shape(cfg)[1], arch.vocab_size)
        loss_fn = policy_loss_fn(cfg.algo.loss, batch)
        # the phases label what they allocate for a tracker; on a real device none is told of a tensor
        runs = _phase_runs(learner, cfg, batch, loss_fn, AllocationTracker(), {})
        learner.train_step(batch, loss_fn)
        for name in wanted:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            kept = runs[name]()
            torch.cuda.synchronize()
            out[name] = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
            del kept
        del learner, runs, loss_fn
    finally:
        destroy_parallel()
    return {"layers": layers, "phases": out}


def planned_phases(cfg: QarlConfig, layers: int, phases: tuple[str, ...]) -> dict[str, int]:
    """The planner's total bytes per phase for ``cfg`` (its layout) with the model cut to ``layers`` layers."""
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.plan.layouts import PlanOptions, learner_settings, local_spec_attention, micro_batch_tokens
    from megatron_qarl.plan.memory import LearnerLayout, step_shape
    from megatron_qarl.plan.step import step_memory
    from megatron_qarl.plan.verdict import step_shape_of

    arch = dataclasses.replace(Qwen3MoeArch.from_model_dir(cfg.model.path), num_hidden_layers=layers)
    lay = LearnerLayout(gpus=cfg.world_size, tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    opts = PlanOptions()
    shape = step_shape_of(cfg, micro_batch_tokens(cfg, lay.dp, opts), step_shape(cfg)[1], learner_settings(cfg, opts))
    shape = dataclasses.replace(shape, attention=local_spec_attention(cfg))
    planned = step_memory(arch, cfg.quant, lay, shape, phases)
    return {p: int(planned[p]["total"]) for p in phases}


def compare(measured: dict, simulated: dict | None, planned: dict[str, int]) -> list[dict]:
    """Rows (phase, device allocated / reserved, simulated, planned; bytes) of one layer count. ``simulated``:
    ``plan.simulate.SimResult.phases`` of the same config and layers (None where it was not run)."""
    rows = []
    for phase, peak in measured["phases"].items():
        sim = None if simulated is None else simulated.get(phase, {}).get("total")
        rows.append({"phase": phase, "layers": measured["layers"], "allocated": peak["allocated"],
                     "reserved": peak["reserved"], "simulated": sim, "planned": planned.get(phase)})
    return rows
