"""Learner memory by simulation (megatron_qarl/plan/simulate.py): one rank of a Qwen3-30B-A3B layout at full width, 2
layers, on the shape-only simulated device, counted by the allocation tracker, held against the planner
(megatron_qarl/plan/step.py): each phase's peak is the sum of its terms, and the phase that sets the step's peak moves
as the planner says when the micro-batch, the recompute or the sequence length change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_qarl.gpu.simulated_device import SimTensor, simulated_cuda
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.layouts import PlanOptions, learner_settings, local_spec_attention, micro_batch_tokens
from megatron_qarl.plan.memory import LearnerLayout
from megatron_qarl.plan.simulate import extrapolate, simulate_learner
from megatron_qarl.plan.tracker import AllocationTracker
from megatron_qarl.preflight.rules import load_config

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.simulated_device,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the simulated device needs none")]

CONFIG = "configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml"  # tp4 (sequence parallel) / ep16 on 16 GPUs, recompute selective


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


def test_a_collective_neither_copies_a_view_nor_relabels_the_tensors_it_touches():
    """An all-gather with a real operand gives small meta operands real values, but not a view of another tensor's
    storage (real zeros would be a second copy while the base lives: the FP8 QAT cache's codes were counted twice
    after a sync), and a tensor whose backing it swaps keeps its label (the INT8 cache's codes stayed qat_cache)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tracker = AllocationTracker()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with simulated_cuda(shapes_only=True, tracker=tracker):
            with tracker.labelled("qat_cache"):
                base = torch.empty(32 * 2**20, dtype=torch.int8, device="cuda")  # beyond SMALL_BYTES: meta
                view = base[: 2**20]  # a small meta view of it
                own = base[: 2**20].clone()  # a small meta tensor with its own storage
            assert view._data.is_meta and own._data.is_meta
            with tracker.labelled("comm_buffers"):
                for t in (view, own):
                    before = tracker.live
                    out = [torch.empty_like(t) for _ in range(2)]  # small factories: real
                    dist.all_gather(out, t)
                    grown = tracker.live - before
                    assert grown == 2 * 2**20, grown  # the outputs only (own's zeros replace its meta storage)
                    del out
            assert view._data.is_meta and not own._data.is_meta  # the view stayed meta; own got real zeros
            assert tracker.by_label["qat_cache"] == 33 * 2**20 and tracker.by_label["comm_buffers"] == 0
    finally:
        dist.destroy_process_group()


def test_shape_only_moe_bookkeeping_is_real_and_balanced():
    """The router's top-k of unknown scores is the balanced stand-in; counts derived from it are real values."""
    with simulated_cuda(shapes_only=True):
        logits = torch.empty(16 * 2304, 128, device="cuda")[:2304]  # beyond SMALL_BYTES: meta, unknown scores
        assert logits._data.is_meta
        _, idx = torch.topk(logits, k=8, dim=1)
        routing_map = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
        counts = routing_map.sum(dim=0).tolist()
    assert counts == [2304 * 8 // 128] * 128


PEAK_PHASES = ("logprob_forward", "train_step", "sync_sender")


def _sim(seq: int, **overrides):
    """(the simulation, the planner's phases) of CONFIG with 2 layers, full-length sequences of ``seq`` tokens and
    64 MiB sync buckets, for PEAK_PHASES."""
    from megatron_qarl.plan.step import step_memory
    from megatron_qarl.plan.verdict import step_shape_of

    half = seq // 2
    sets = {"data.max_prompt_tokens": half, "rollout.sampling.max_new_tokens": seq - half,
            "rollout.sync.bucket_mb": 64, **overrides}
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in sets.items()])
    sim = simulate_learner(cfg, layers=2, phases=PEAK_PHASES)
    arch = dataclasses.replace(Qwen3MoeArch.from_model_dir(cfg.model.path), num_hidden_layers=2)
    lay = LearnerLayout(gpus=cfg.world_size, tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    opts = PlanOptions(attention=local_spec_attention(cfg))  # the local spec's, as the simulation runs
    st = learner_settings(cfg, opts)
    shape = step_shape_of(cfg, micro_batch_tokens(cfg, lay.dp, opts), seq, st)
    return sim, step_memory(arch, cfg.quant, lay, shape, PEAK_PHASES)


def _peak(phases: dict) -> str:
    return max(phases, key=lambda p: phases[p]["total"])


@pytest.mark.e2e  # five simulations of a 2-layer Qwen3-30B-A3B rank (a few minutes on two cores)
def test_micro_batch_recompute_and_sequence_length_move_the_peak_phase_as_the_planner_says():
    """Short sequences: rank 0's sync (bucket + the lm_head's TP gather) sets the step's peak; eight sequences per
    micro-batch, longer sequences, or no recompute move it to the train step; full recompute moves it back."""
    cases = {
        "1 x 1024 tokens, selective": (1024, {}),
        "micro-batch 8 x 1024": (1024, {"learner.micro_batch_size": 8}),
        "sequence 4096": (4096, {}),
        "2 x 2048, no recompute": (2048, {"learner.micro_batch_size": 2, "learner.recompute": "none"}),
        "2 x 2048, full recompute": (2048, {"learner.micro_batch_size": 2, "learner.recompute": "full"}),
    }
    peaks = {}
    for name, (seq, overrides) in cases.items():
        sim, plan = _sim(seq, **overrides)
        at = sim.phases
        assert sum(v for k, v in at["train_step"].items() if k not in ("total", "rounding")) == \
            at["train_step"]["total"], name
        for part in ("weights", "gradients", "optimizer"):  # the persistent state: the planner's formulas
            assert at["train_step"][part] == pytest.approx(plan["train_step"][part], rel=0.01), (name, part)
        peaks[name] = (_peak(at), _peak(plan))
        assert peaks[name][0] == peaks[name][1], (name, {p: v["total"] for p, v in at.items()},
                                                  {p: v["total"] for p, v in plan.items()})
        assert at[peaks[name][0]]["total"] == pytest.approx(plan[peaks[name][1]]["total"], rel=0.10), name
    assert peaks["1 x 1024 tokens, selective"][0] == "sync_sender"
    for moved in ("micro-batch 8 x 1024", "sequence 4096", "2 x 2048, no recompute"):
        assert peaks[moved][0] == "train_step", moved
    assert peaks["2 x 2048, full recompute"][0] == "sync_sender"


def test_extrapolation_is_the_line_through_two_layer_counts():
    from megatron_qarl.plan.simulate import SimResult
    from megatron_qarl.plan.tracker import LABELS

    def phase(**kw):
        return {**dict.fromkeys(LABELS, 0), **kw, "total": sum(kw.values())}

    a = SimResult(layers=2, phases={"train_step": phase(weights=4, act_layer=6)}, sync={"bytes": 10}, seconds=0,
                  micro_batch_tokens=1)
    b = SimResult(layers=4, phases={"train_step": phase(weights=6, act_layer=10)}, sync={"bytes": 14}, seconds=0,
                  micro_batch_tokens=1)
    got = extrapolate(a, b, 48)
    step = got["phases"]["train_step"]
    assert step["weights"] == 4 + 2 * 46 / 2 and step["act_layer"] == 6 + 4 * 46 / 2 and step["total"] == 10 + 6 * 23
    assert got["sync"]["bytes"] == 10 + 2 * 46
    assert a.terms()["activations"] == 6 and a.terms()["total"] == 10


def _measured_on_the_simulated_device() -> dict:
    import torch.distributed as dist

    from megatron_qarl.gpu.simulated_device import simulated_cuda
    from megatron_qarl.moe.parallelize import single_rank_env
    from megatron_qarl.plan.measure import compare, measure_phases, one_gpu, planned_phases
    from megatron_qarl.plan.phases import phases_of
    from megatron_qarl.preflight.rules import load_config

    cfg = one_gpu(load_config(str(REPO / "configs" / "cpu_default.yaml"),
                              ["parallel.tp=1", "train.prompts_per_step=2", "rollout.sampling.n_samples=2",
                               "learner.micro_batch_size=2"]))
    single_rank_env()
    dist.init_process_group("gloo")  # the simulated GPU's groups are gloo (gpu/smoke.py does the same)
    with simulated_cuda():
        measured = measure_phases(cfg, layers=1)
    planned = planned_phases(cfg, 1, tuple(measured["phases"]))
    return {"phases": [p.name for p in phases_of(cfg)], "measured": measured, "planned": planned,
            "rows": compare(measured, {p: {"total": 1} for p in measured["phases"]}, planned)}


def test_the_planner_meets_the_device_code_runs_every_phase_on_a_simulated_one():
    """plan/measure.py (benchmarks/gpu_learner.py --plan, run on a lent GPU) builds the learner qarl train builds, cut
    to one GPU, and runs each phase the config runs with the allocator's peak read after it: here on the simulated
    device (whose allocator statistics are stand-ins, 0), so that a lent GPU's one call does not fail on the code;
    the planner's figure for each phase is positive, and the rows pair them phase by phase."""
    from megatron_qarl.moe.parallelize import run_ranks

    r = run_ranks(1, _measured_on_the_simulated_device)[0]
    assert list(r["measured"]["phases"]) == r["phases"] and r["measured"]["layers"] == 1
    assert all(set(v) == {"allocated", "reserved"} for v in r["measured"]["phases"].values())
    assert set(r["planned"]) == set(r["phases"]) and all(v > 0 for v in r["planned"].values())
    assert [row["phase"] for row in r["rows"]] == r["phases"]
    assert all(row["planned"] == r["planned"][row["phase"]] and row["simulated"] == 1 for row in r["rows"])


def _codes_with_an_unknown_flag() -> dict:
    from megatron_qarl.moe.model import build_model
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.modules import apply_fake_quant
    from tests.test_learner_launches import arch_with

    init_parallel()
    arch = arch_with(8)
    fq = apply_fake_quant(build_model(arch), arch, QuantConfig(scheme="w4a16"))
    t = next(t for t in fq.targets if t.stack is not None)
    fq.target_codes(t)  # refreshed on the CPU
    t.quantized = None
    with simulated_cuda(shapes_only=True):
        unknown = torch.empty(1 << 23, device="cuda").isfinite().all()  # 32 MiB: shape-only, its value unknown
        t.stack.finite = unknown
        stand_in = bool(unknown)
        codes = fq.target_codes(t)
    return {"stand_in": stand_in, "codes": sorted(codes)}


def test_the_weight_sync_of_a_simulated_quantized_learner_takes_an_unknown_finiteness_flag_as_finite():
    """qarl plan --simulate of a quantized config at full size: the sync phase asks each target for its codes, whose
    finiteness flag the shape-only device does not know, and answers 0 / False for (``_scalar_stand_in``: "no
    inf/nan found"). target_codes asks "any non-finite?" so that answer passes; it asked "all finite?" and refused
    every stacked expert weight as non-finite (found by simulating configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml)."""
    from megatron_qarl.moe.parallelize import run_ranks

    r = run_ranks(1, _codes_with_an_unknown_flag)[0]
    assert r["stand_in"] is False and len(r["codes"]) == 2, r  # gate_proj and up_proj of one expert


def test_the_benchmark_takes_overrides_as_key_value_like_every_command():
    """benchmarks/memory_sim.py's configs and ``key.sub=value`` overrides, in any order (docs/plan.md's commands)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_sim", REPO / "benchmarks" / "memory_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.split_overrides(["configs/a.yaml", "model.path=configs/models/x", "configs/b=c.yaml",
                                "launch.nodes=8"]) == (["configs/a.yaml", "configs/b=c.yaml"],
                                                       ["model.path=configs/models/x", "launch.nodes=8"])
