"""The learner at Qwen3-30B-A3B layer shapes on one GPU, per scheme: what fake quantization costs (issue 37), and the
local spec's core attention, torch's fused SDPA against Megatron's unfused one (issue 55).

    python benchmarks/gpu_learner.py [--out benchmarks/results/gpu_learner.md]        (scripts/gpu_smoke.sh --bench)
    python benchmarks/gpu_learner.py --rows attention [--out ...]                     (the attention rows only)
    python benchmarks/gpu_learner.py --device cpu --small                            (a dry run of the same code)

Each row in its own process (a fresh CUDA context, ModelOpt's state, the allocator's peak): a TP1/EP1 ``Learner``
(local spec, bf16 parameters) of hidden 2048, 128 experts top-8, expert FFN 768, 32 / 4 heads of 128, vocab 151936,
2 layers (and W4A16 at 8), on 4 x 1024 tokens; after a warm-up step, the median of 3 of a log-prob forward (which
re-quantizes every expert weight the optimizer changed) and of a train step. Per call, from torch.profiler: kernel
launches (CUDA kernels; on a CPU, aten ops) and host syncs (``aten::_local_scalar_dense``, ``aten::item``,
``aten::is_nonzero``, ``aten::nonzero``). Then the quantizer alone: one refresh of a stacked [128 x 768, 2048] fp32
expert weight (``fake_quantize_weight``), its GB/s counting the fp32 read and the bf16 fake-quant weight, int8 codes
and bf16 scales it writes, for every scheme and refresh kernel (``learner.refresh_kernel``: ``auto`` is the Triton
kernel on CUDA, qat/triton_refresh.py; ``torch`` the reference ops). ``--small`` shrinks the model (hidden 256, 16
experts, vocab 4096, 2 x 128 tokens) so a CPU runs the whole table in a few minutes: it checks the script, its figures
mean nothing for a GPU.

The expert rows (``EXPERT_ROWS``, ``model.experts``): bf16, w4a16 and w8a8_fp8 with Megatron's SequentialMLP, beside
the scheme rows above, which run the default (``auto``: the grouped experts of moe/grouped.py on sm90 / sm100 with
bf16 parameters; the "experts" column says what each learner built). Every row gives the step's wall time against its
GPU-busy time (the profiled step's CUDA kernel times, summed: where the wall time is far above it, the step is
launch-bound) and its tokens/s.

The attention rows (``ATTENTION_ROWS``, ``model.attention``): bf16, 2 layers, one sequence of 4096 tokens, the sdpa
and the unfused core attention (the scheme rows above run the default, sdpa). Every row gives the train step's
model FLOPs utilisation: MFU = F / (train_step s x the GPU's peak), F = 6 N T + 6 L a d s^2 per sequence (N the
active parameters without the embedding, T tokens; the causal attention's QK^T and PV, each s^2 / 2 x a x d
multiply-adds forward, twice that backward: what a causal fused kernel computes; the unfused one computes the whole
s^2), the peak the dense BF16 tensor-core figure of NVIDIA's datasheets (``PEAK_BF16``; H100 SXM / H200: 989.4
TFLOPS, H100 PCIe: 756 TFLOPS); "-" on other devices. The train step also steps Adam and re-quantizes the weights,
so this MFU is the learner's, not the GEMMs'.

``--plan CONFIG``: the planner meets the GPU (plan/measure.py). The config cut to one GPU (TP 1, EP 1) and to each of
``--plan-layers`` (2 4), its phases run on the device, each phase's allocator peak (allocated, reserved) beside
``qarl plan --simulate``'s simulation of the same and the planner's figure. The simulation is device-independent and
takes minutes on a CPU: ``--plan-sim FILE`` reads it from FILE, or makes it (in a process with the GPUs hidden) and
writes it there, so a CPU machine makes it ahead of a short GPU lease:
    python benchmarks/gpu_learner.py --device cpu --rows none --plan CONFIG --plan-sim FILE
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")
# (scheme, learner.compile_quantizer, layers, learner.refresh_kernel, model.attention, (sequences, tokens each),
#  model.experts)
ROWS = [("bf16", False, 2, "auto", "sdpa", (4, 1024), "auto"), ("w4a16", False, 2, "auto", "sdpa", (4, 1024), "auto"),
        ("w4a16", False, 2, "torch", "sdpa", (4, 1024), "auto"), ("w4a16", True, 2, "auto", "sdpa", (4, 1024), "auto"),
        ("w8a8_fp8", False, 2, "auto", "sdpa", (4, 1024), "auto"),
        ("w8a8_int8", False, 2, "auto", "sdpa", (4, 1024), "auto"),
        ("w4a16", False, 8, "auto", "sdpa", (4, 1024), "auto")]
EXPERT_ROWS = [(scheme, False, 2, "auto", "sdpa", (4, 1024), "sequential") for scheme in ("bf16", "w4a16", "w8a8_fp8")]
ATTENTION_ROWS = [("bf16", False, 2, "auto", attention, (1, 4096), "auto") for attention in ("sdpa", "unfused")]
SMALL_SHAPE = {(4, 1024): (2, 128), (1, 4096): (1, 512)}  # --small: the shapes a CPU runs in seconds
# dense BF16 tensor-core FLOP/s (no sparsity), NVIDIA's H100 / H200 datasheets; matched in the device's name in order
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12))
SCHEMES = ("w4a16", "w8a8_fp8", "w8a8_int8")


def row_name(scheme: str, compiled: bool, kernel: str, attention: str = "sdpa", experts: str = "auto") -> str:
    return scheme + (" (compile_quantizer)" if compiled else "") + (f" (refresh_kernel={kernel})"
                                                                    if kernel != "auto" else "") + \
        (f" (attention={attention})" if attention != "sdpa" else "") + \
        (f" (experts={experts})" if experts != "auto" else "")


def train_flops(a, sequences: int, seq: int) -> float:
    """Model FLOPs of one train step (module docstring): 6 N T + 6 L a d s^2 per sequence, N the active parameters
    without the embedding (``plan.memory.param_counts``)."""
    from megatron_qarl.plan.memory import param_counts

    n = param_counts(a)["active_non_embedding"]
    return 6 * n * sequences * seq + sequences * 6 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * seq**2


def peak_flops(device: str) -> float | None:
    """The device's dense BF16 peak (``PEAK_BF16``), None where it is not in the table (and on a CPU)."""
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def arch(layers: int, small: bool):
    from megatron_qarl.moe.model import Qwen3MoeArch

    if small:
        return Qwen3MoeArch(vocab_size=4096, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
                            moe_intermediate_size=128, intermediate_size=512, rms_norm_eps=1e-6, rope_theta=1e6,
                            max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False,
                            attention_bias=False)
    return Qwen3MoeArch(vocab_size=151936, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=768, intermediate_size=6144, rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=40960, norm_topk_prob=True, tie_word_embeddings=False,
                        attention_bias=False)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _profiled(fn, device: str) -> dict:
    """Launches (CUDA kernels, or aten ops on a CPU), host syncs and GPU-busy seconds (the kernels' times, summed; None
    on a CPU) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    events = prof.events()
    busy = None
    if device == "cuda":
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        launches, busy = len(kernels), sum(e.device_time for e in kernels) / 1e6
    else:
        launches = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
    syncs = sum(1 for e in events if e.name in SYNC_OPS)
    return {"launches": launches, "syncs": syncs, "busy_s": busy}


def _timed(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(scheme: str, compiled: bool, layers: int, kernel: str, attention: str, shape: tuple[int, int], device: str,
        small: bool, repeats: int, experts: str = "auto") -> dict:
    """One row, in this process."""
    import torch

    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.parallelize import init_parallel, single_rank_env
    from megatron_qarl.qat.config import QuantConfig

    single_rank_env()
    init_parallel()
    a = arch(layers, small)
    learner = Learner(a, ParallelConfig(), OptimConfig(lr=1e-5), dtype=torch.bfloat16,
                      quant=QuantConfig(scheme=scheme), compile_quantizer=compiled, refresh_kernel=kernel,
                      attention=attention, experts=experts)
    rows, seq = SMALL_SHAPE[tuple(shape)] if small else tuple(shape)
    tokens = torch.randint(0, a.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens, torch.ones(rows, seq - 1))

    def step():
        learner.train_step(batch, lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.numel()))

    def forward():  # after a step: every quantized weight changed, so it is re-quantized here
        with torch.no_grad():
            learner.logprobs(tokens)

    step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_fwd, t_step = [], []
    for _ in range(repeats):
        t_step.append(_timed(step, device, 1))
        t_fwd.append(_timed(forward, device, 1))
    step()  # weights changed: the profiled forward refreshes, as in training
    fwd_prof = _profiled(forward, device)
    step_prof = _profiled(step, device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    used = learner.fake_quant.kernel if learner.fake_quant else "-"
    step_s, gpu_peak = statistics.median(t_step), peak_flops(device)
    return {"scheme": row_name(scheme, compiled, kernel, attention, experts), "layers": layers, "kernel": used,
            "experts": learner.experts, "tokens_per_s": rows * seq / step_s,
            "tokens": f"{rows} x {seq}", "forward_s": statistics.median(t_fwd), "step_s": step_s, "peak_gib": peak,
            "mfu": train_flops(a, rows, seq) / step_s / gpu_peak if gpu_peak else None,
            "forward": fwd_prof, "step": step_prof}


def quantizer_alone(device: str, small: bool, repeats: int) -> list[dict]:
    """One refresh of the stacked expert weights of a projection, per scheme and refresh kernel: GB/s over the bytes
    it must move (the fp32 read; the bf16 fake-quant weight, the 1-byte codes and the scales written)."""
    import torch

    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.modules import resolve_refresh_kernel
    from megatron_qarl.qat.quantizer import fake_quantize_weight

    n, k = (16 * 128, 256) if small else (128 * 768, 2048)
    w = torch.randn(n, k, device=device)
    kernels = ["torch"] + (["triton"] if resolve_refresh_kernel("auto", w.device) == "triton" else [])
    out = []
    for scheme in SCHEMES:
        cfg = QuantConfig(scheme=scheme)
        for kernel in kernels:
            if kernel == "triton":
                from megatron_qarl.qat.triton_refresh import fake_quantize_triton

                def fn(cfg=cfg):
                    return fake_quantize_triton(w, cfg)
            else:
                def fn(cfg=cfg):
                    return fake_quantize_weight(w, cfg, check_finite=False)
            qw, _ = fn()  # warm-up (Triton compiles here)
            seconds = _timed(fn, device, repeats)
            moved = n * k * (4 + 2 + 1) + qw.scales.numel() * qw.scales.element_size()
            out.append({"scheme": scheme, "kernel": kernel, "shape": [n, k], "seconds": seconds,
                        "gb_s": moved / seconds / 1e9, "launches": _profiled(fn, device)["launches"]})
    return out


def plan_rows(config: str, layers: list[int], device: str, sim_file: Path | None) -> list[dict]:
    """``--plan``: per layer count, the phases on the device (a process each; on a CPU, skipped), the simulation and
    the planner for ``config`` cut to one GPU (plan/measure.py). The simulation is read from ``sim_file`` when it
    exists (made on any machine: it is device-independent), else run in a process with the GPUs hidden and saved
    there."""
    import os

    sims = json.loads(sim_file.read_text()) if sim_file and sim_file.exists() else {}
    if sims and (sims.get("config") != config or any(str(n) not in sims["layers"] for n in layers)):
        raise SystemExit(f"--plan-sim {sim_file}: made for {sims.get('config')} at layers {list(sims['layers'])}, "
                         f"not {config} at {layers}")
    ctx = mp.get_context("spawn")
    rows = []
    for n in layers:
        if str(n) not in sims.get("layers", {}):
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the child's torch sees no GPU: the simulated device runs
            try:
                sim = _in_child(ctx, "simulated", config, n, device)
            finally:
                os.environ.pop("CUDA_VISIBLE_DEVICES") if saved is None else os.environ.update(
                    CUDA_VISIBLE_DEVICES=saved)
            if "error" not in sim and sim_file:
                sims = {"config": config, "layers": {**sims.get("layers", {}), str(n): sim}}
                sim_file.write_text(json.dumps(sims, indent=1) + "\n")
        else:
            sim = sims["layers"][str(n)]
        dev = (_in_child(ctx, "device", config, n, device) if device == "cuda"
               else {"error": "no CUDA device: the device side runs on a GPU only"})
        rows.append({"layers": n, "device": dev, "simulated": sim})
        print(json.dumps(rows[-1], default=str), flush=True)
    return rows


def _in_child(ctx, what: str, config: str, layers: int, device: str) -> dict:
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_plan_child, args=(what, config, layers, device, q))
    p.start()
    p.join()
    return q.get() if not q.empty() else {"error": f"the {what} process exited with {p.exitcode}"}


def _plan_child(what: str, config: str, layers: int, device: str, q) -> None:
    try:
        from megatron_qarl.plan.measure import measure_phases, one_gpu, planned_phases
        from megatron_qarl.preflight.rules import load_config

        cfg = one_gpu(load_config(config, []))
        if what == "simulated":
            from megatron_qarl.plan.simulate import simulate_learner

            sim = simulate_learner(cfg, layers=layers)
            q.put({"phases": {p: v["total"] for p, v in sim.phases.items()}, "seconds": sim.seconds,
                   "planned": planned_phases(cfg, layers, tuple(sim.phases))})
        else:
            q.put(measure_phases(cfg, layers=layers)["phases"])
    except Exception as err:  # noqa: BLE001 - reported in the table
        q.put({"error": f"{type(err).__name__}: {str(err)[:300]}"})


def _child(args, q) -> None:
    try:
        q.put(row(*args))
    except Exception as err:  # noqa: BLE001 - a row that fails is reported in the table, the others still run
        q.put({"scheme": row_name(args[0], args[1], args[3], args[4], args[9]), "layers": args[2],
               "error": f"{type(err).__name__}: {str(err)[:300]}"})


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def render_plan(rows: list[dict], config: str) -> list[str]:
    out = ["", f"The planner on the device: {config} cut to one GPU (TP 1, EP 1), GiB per phase: the allocator's peak "
           "(allocated / reserved) beside the simulation's and the plan's.", "",
           "| layers | phase | device allocated | device reserved | simulated | planned | simulated / device | "
           "planned / device |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dev, sim = r["device"], r["simulated"]
        if "error" in sim:
            out.append(f"| {r['layers']} | simulation failed: {sim['error']} |||||||")
            continue
        for phase in sim["phases"]:
            s, p = sim["phases"][phase], sim["planned"].get(phase)
            peak = dev.get(phase) if "error" not in dev else None
            a = peak["allocated"] if peak else None
            ratios = f"{s / a:.2f} | {p / a:.2f}" if a and s and p else "- | -"
            out.append(f"| {r['layers']} | {phase} | {_gib(a)} | {_gib(peak['reserved'] if peak else None)} | "
                       f"{_gib(s)} | {_gib(p)} | {ratios} |")
        if "error" in dev:
            out.append(f"| {r['layers']} | device: {dev['error']} |||||||")
    return out


def render(rows: list[dict], alone: list[dict], device: str, small: bool) -> str:
    import torch

    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({'--small' if small else 'full size'})"
    base = {(r["layers"], r["tokens"]): r for r in rows if r["scheme"] == "bf16" and "error" not in r}
    out = [f"Device: {where}; torch {torch.__version__}; median of the timed calls after a warm-up step.", "",
           "| scheme | experts | refresh | layers | tokens | log-prob forward s | train_step s (GPU-busy) | tokens/s | "
           "forward + step | vs bf16 | peak GiB | train-step MFU | forward launches / syncs | step launches / syncs |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['scheme']} | - | - | {r['layers']} | - | failed: {r['error']} ||||||||||")
            continue
        total = r["forward_s"] + r["step_s"]
        ref = base.get((r["layers"], r["tokens"]))
        ratio = f"{total / (ref['forward_s'] + ref['step_s']):.2f}x" if ref else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        busy = r["step"].get("busy_s")
        step = f"{r['step_s']:.3f}" + (f" ({busy:.3f})" if busy is not None else "")
        out.append(f"| {r['scheme']} | {r['experts']} | {r['kernel']} | {r['layers']} | {r['tokens']} | "
                   f"{r['forward_s']:.3f} | {step} | {r['tokens_per_s']:.0f} | {total:.3f} | {ratio} | {peak} | "
                   f"{mfu} | {r['forward']['launches']} / "
                   f"{r['forward']['syncs']} | {r['step']['launches']} / {r['step']['syncs']} |")
    if not alone:
        return "\n".join(out) + "\n"
    out += ["", f"The quantizer alone, one refresh of a stacked {alone[0]['shape']} fp32 weight (GB/s over the fp32 "
                "read and the bf16 weight, 1-byte codes and scales written):", "",
            "| scheme | refresh kernel | ms | GB/s | launches |", "|---|---|---|---|---|"]
    out += [f"| {a['scheme']} | {a['kernel']} | {a['seconds'] * 1e3:.2f} | {a['gb_s']:.1f} | {a['launches']} |"
            for a in alone]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="a small model: checks the script on a CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="all", help=f"comma-separated row indices (0-{len(ROWS) - 1}), 'all' "
                                                      "(the scheme rows, the quantizer table, the expert rows and the "
                                                      "attention rows), 'schemes', 'experts', 'attention' or 'none'")
    parser.add_argument("--plan", default=None, metavar="CONFIG", help="the planner on the device (one GPU)")
    parser.add_argument("--plan-layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--plan-sim", type=Path, default=None,
                        help="the simulation's JSON: read when it exists, else made (GPUs hidden) and written")
    parser.add_argument("--out", default=None, help="also write the table here (markdown), after each stage")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_learner: no CUDA device here (--device cpu --small checks the script on a CPU)")
    named = {"all": ROWS + EXPERT_ROWS + ATTENTION_ROWS, "schemes": ROWS, "experts": EXPERT_ROWS,
             "attention": ATTENTION_ROWS, "none": []}
    if args.rows in named:
        chosen = named[args.rows]
    else:
        chosen = [ROWS[int(i)] for i in args.rows.split(",")]
    ctx = mp.get_context("spawn")
    results, parts = [], []

    def write(text: str) -> None:
        parts.append(text)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text("\n".join(parts))

    for scheme, compiled, layers, kernel, attention, shape, experts in chosen:
        q = ctx.SimpleQueue()
        p = ctx.Process(target=_child, args=((scheme, compiled, layers, kernel, attention, shape, args.device,
                                              args.small, args.repeats, experts), q))
        p.start()
        p.join()
        results.append(q.get() if not q.empty() else {"scheme": row_name(scheme, compiled, kernel, attention, experts),
                                                      "layers": layers,
                                                      "error": f"the row's process exited with {p.exitcode}"})
        print(json.dumps(results[-1]), flush=True)
    if chosen:
        alone = quantizer_alone(args.device, args.small, args.repeats) if args.rows not in ("attention", "experts") \
            else []
        write(render(results, alone, args.device, args.small))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.plan:
        write("\n".join(render_plan(plan_rows(args.plan, args.plan_layers, args.device, args.plan_sim), args.plan))
              + "\n")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
