"""Learner memory by simulation (megatron_qarl/plan/simulate.py): one rank of a Qwen3-30B-A3B layout at full width, 2
layers, on the shape-only simulated device, counted by the allocation tracker, held against the planner
(megatron_qarl/plan/memory.py): the simulated peak is the sum of its phases, and it moves as the planner says when the
micro-batch, the recompute or the optimizer offload change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_qarl.gpu.simulated_device import SimTensor, simulated_cuda
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.cli import PlanOptions, _learner_memory
from megatron_qarl.plan.memory import LearnerLayout
from megatron_qarl.plan.simulate import AllocationTracker, extrapolate, simulate_learner
from megatron_qarl.preflight.rules import load_config

pytestmark = [pytest.mark.simulated_device,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the simulated device needs none")]

CONFIG = "configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml"  # tp4 (sequence parallel) / ep16 on 16 GPUs, recompute selective
# full-length sequences of 1024 + 1024 tokens, learner.micro_batch_size of them per data-parallel rank
SHORT = {"data.max_prompt_tokens": 1024, "rollout.sampling.max_new_tokens": 1024}


def test_the_tracker_counts_each_storage_once_while_a_tensor_of_it_lives():
    tracker = AllocationTracker()
    with simulated_cuda(shapes_only=True, tracker=tracker):
        with tracker.labelled("weights"):
            w = torch.empty(1024, 1024, device="cuda")  # 4 MiB: small, real values
            big = torch.empty(8192, 1024, device="cuda")  # 32 MiB: shape only
        view = big[:10]
        assert isinstance(big, SimTensor) and big._data.is_meta and not w._data.is_meta
        assert tracker.live == (1 + 8) * 4 * 2**20 and tracker.by_label["weights"] == tracker.live
        del big
        assert tracker.live == 36 * 2**20  # the view keeps the storage
        del view
        assert tracker.live == 4 * 2**20 and tracker.peak == 36 * 2**20


def test_shape_only_moe_bookkeeping_is_real_and_balanced():
    """The router's top-k of unknown scores is the balanced stand-in; counts derived from it are real values."""
    with simulated_cuda(shapes_only=True):
        logits = torch.empty(16 * 2304, 128, device="cuda")[:2304]  # beyond SMALL_BYTES: meta, unknown scores
        assert logits._data.is_meta
        _, idx = torch.topk(logits, k=8, dim=1)
        routing_map = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
        counts = routing_map.sum(dim=0).tolist()
    assert counts == [2304 * 8 // 128] * 128


def _sim(**overrides):
    """(the simulation, the planner's figures) of CONFIG with 2 layers and SHORT sequences."""
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in {**SHORT, **overrides}.items()])
    sim = simulate_learner(cfg, layers=2)
    arch = dataclasses.replace(Qwen3MoeArch.from_model_dir(cfg.model.path), num_hidden_layers=2)
    lay = LearnerLayout(gpus=cfg.world_size, tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    plan = _learner_memory(cfg, arch, lay, PlanOptions(attention="unfused"))
    return sim, plan


def test_simulated_peak_is_its_phases_and_moves_as_the_planner_says():
    base, plan = _sim()
    assert sum(base.at_peak.values()) == base.peak == base.phases["total"]
    for part in ("weights", "gradients", "optimizer"):  # the persistent state: the planner's formulas exactly
        assert base.phases[part] == pytest.approx(plan[part], rel=0.01), part
    assert base.phases["total"] == pytest.approx(plan["total"], rel=0.10)
    variants = {
        "micro-batch x2": _sim(**{"learner.micro_batch_size": 2}),
        "recompute none": _sim(**{"learner.recompute": "none"}),
        "optimizer offload": _sim(**{"learner.optimizer_cpu_offload": "true"}),
    }
    for name, (sim, p) in variants.items():
        sim_ratio, plan_ratio = sim.peak / base.peak, p["total"] / plan["total"]
        assert (sim_ratio > 1) == (plan_ratio > 1), name
        assert sim_ratio == pytest.approx(plan_ratio, rel=0.10), (name, sim.phases, p)


def test_extrapolation_is_the_line_through_two_layer_counts():
    from megatron_qarl.plan.simulate import SimResult

    a = SimResult(layers=2, peak=10, at_peak={"weights": 4, "activations": 6}, seconds=0,
                  micro_batch_tokens=1)
    b = SimResult(layers=4, peak=16, at_peak={"weights": 6, "activations": 10}, seconds=0,
                  micro_batch_tokens=1)
    got = extrapolate(a, b, 48)
    assert got["weights"] == 4 + 2 * 46 / 2 and got["activations"] == 6 + 4 * 46 / 2 and got["total"] == 10 + 6 * 23
