"""The planner against the simulation, term by term and phase by phase (``qarl plan --simulate``,
benchmarks/memory_sim.py).

Terms of a phase: the persistent ones (weights, gradients, optimizer, qat_cache), ``transient`` (everything else the
phase holds at its peak: the simulation's activation kinds, the planner's activations, comm buffers and attention
buffer) and ``total``. The simulation runs Megatron's local spec, so the planner is asked for its attention (the
caller's ``shape.attention``: sdpa or unfused, ``plan.layouts.local_spec_attention``).
Phases linear in the layer count are compared at the model's layers (the simulation extrapolated from two layer
counts); the sync phases are not (the bucket bounds them), so they are compared at each simulated layer count with
the planner evaluated at that count. A term is non-trivial when the simulation holds at least ``TRIVIAL_BYTES`` of
it; ``largest`` is the largest relative error over the non-trivial terms of the phases but the sync,
``largest_sync`` over the sync's (the planner's sync is a bound: rank 0's bucket at its fullest when the largest
high-precision tensor arrives).
"""

from __future__ import annotations

import dataclasses

from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.memory import GIB, LOCAL_SPEC_ATTENTIONS, LearnerLayout
from megatron_qarl.plan.step import PERSISTENT, StepShape, step_memory
from megatron_qarl.plan.tracker import ACTIVATION_KINDS

TERMS = (*PERSISTENT, "transient", "total")
TRIVIAL_BYTES = GIB // 4
LINEAR_IN_LAYERS = ("logprob_forward", "r3_forward", "train_step", "checkpoint_save", "eval_forward")


def sim_terms(at: dict[str, int]) -> dict[str, int]:
    """A simulated phase's bytes by ``TERMS``."""
    out = {k: at.get(k, 0) for k in PERSISTENT}
    out["transient"] = sum(at.get(k, 0) for k in ACTIVATION_KINDS)
    out["total"] = at["total"]
    return out


def plan_terms(planned: dict[str, int]) -> dict[str, int]:
    """A planned phase's bytes by ``TERMS``."""
    out = {k: planned.get(k, 0) for k in PERSISTENT}
    out["total"] = planned["total"]
    out["transient"] = out["total"] - sum(out[k] for k in PERSISTENT)
    return out


def _rows(phase: str, layers: int, plan: dict[str, int], sim: dict[str, int]) -> list[dict]:
    rows = []
    for term in TERMS:
        p, s = plan[term], sim[term]
        rows.append({"phase": phase, "layers": layers, "term": term, "plan": p, "simulated": s,
                     "diff": (p - s) / s if s else (0.0 if not p else None),
                     "non_trivial": s >= TRIVIAL_BYTES})
    return rows


def compare(arch: Qwen3MoeArch, quant, lay: LearnerLayout, shape: StepShape, sim: dict) -> dict:
    """Rows (phase, layers, term, plan, simulated, diff) for ``sim`` (``plan.simulate.simulate_config``'s dict) and
    the largest relative error over the non-trivial terms. ``shape.attention``: the local spec's attention the
    simulation ran (sdpa or unfused)."""
    if shape.attention not in LOCAL_SPEC_ATTENTIONS:
        raise ValueError(f"attention: {shape.attention!r}: the simulation runs the local spec (sdpa or unfused)")
    rows = []
    full = sim["extrapolated"]["phases"]
    linear = tuple(p for p in LINEAR_IN_LAYERS if p in full)
    planned = step_memory(arch, quant, lay, shape, linear)
    for phase in linear:
        rows += _rows(phase, arch.num_hidden_layers, plan_terms(planned[phase]), sim_terms(full[phase]))
    for run in sim["simulated"]:
        sync = tuple(p for p in ("sync_sender", "sync_peer") if p in run["phases"])
        small = dataclasses.replace(arch, num_hidden_layers=run["layers"])
        planned = step_memory(small, quant, lay, shape, sync)
        for phase in sync:
            rows += _rows(phase, run["layers"], plan_terms(planned[phase]), sim_terms(run["phases"][phase]))
    scored = [r for r in rows if r["non_trivial"] and r["diff"] is not None]

    def worst(sync: bool) -> dict | None:
        mine = [r for r in scored if r["phase"].startswith("sync") == sync]
        return max(mine, key=lambda r: abs(r["diff"])) if mine else None

    return {"rows": rows, "largest": worst(False), "largest_sync": worst(True)}
