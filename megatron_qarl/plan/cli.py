"""``qarl plan``: per-GPU memory of the learner and the rollout servers, and which layouts fit a GPU.

    qarl plan --model DIR [--scheme S] [--nodes 2 4] [--gpus-per-node 8] [--gpu-gib 79.65] [--json]
    qarl plan --config C [key.sub=value ...] [--gpu-gib 79.65] [--json]

``--config`` plans that run (``plan.layouts.config_plan``: its learner and rollout layouts, and which other layouts of
its cluster fit); ``--model`` plans the public Qwen3-30B-A3B recipe's step for that model and scheme over every layout
of ``--nodes`` x ``--gpus-per-node`` GPUs (``plan.layouts.make_plan``); ``--simulate`` sets a simulation of the
config's learner rank beside the plan. The report's text is ``plan.render``'s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_qarl.errors import UserError
from megatron_qarl.plan.layouts import (
    H100_GIB,
    H200_GIB,
    PlanOptions,
    config_plan,
    make_plan,
    recipe_config,
    simulation_check,
)
from megatron_qarl.plan.memory import (
    ATTENTIONS,
    RECOMPUTES,
)
from megatron_qarl.plan.render import render_config_text, render_simulation_text, render_text
from megatron_qarl.preflight.rules import load_config
from megatron_qarl.qat.config import SCHEMES


def _check_flags(args: argparse.Namespace) -> None:
    """The numeric flags, named as the user typed them."""
    checks = [("--gpu-gib", args.gpu_gib, args.gpu_gib is None or args.gpu_gib > 0, "must be > 0"),
              ("--gpus-per-node", args.gpus_per_node, args.gpus_per_node >= 1, "must be >= 1"),
              ("--micro-batch-tokens", args.micro_batch_tokens,
               args.micro_batch_tokens is None or args.micro_batch_tokens >= 1, "must be >= 1"),
              ("--mem-fraction-static", args.mem_fraction_static, 0 < args.mem_fraction_static < 1,
               "must be between 0 and 1"),
              ("--nodes", args.nodes, all(n >= 1 for n in args.nodes), "each entry must be >= 1"),
              ("--simulate-layers", args.simulate_layers,
               len(set(args.simulate_layers)) >= 2 and all(n >= 1 for n in args.simulate_layers),
               "needs two or more distinct layer counts >= 1")]
    for flag, value, ok, rule in checks:
        if not ok:
            raise UserError(f"{flag}: {rule}, got {value}")


def _options(args: argparse.Namespace, gpu_gib: float) -> PlanOptions:
    return PlanOptions(gpu_gib=gpu_gib, micro_batch_tokens=args.micro_batch_tokens,
                       distributed_optimizer=args.distributed_optimizer,
                       optimizer_cpu_offload=args.optimizer_cpu_offload, recompute=args.recompute,
                       attention=args.attention)


def _run_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    opts = _options(args, args.gpu_gib or cfg.launch.gpu_gib or H100_GIB)
    plan = config_plan(cfg, opts)
    check = simulation_check(cfg, opts, args.simulate_layers) if args.simulate else None
    data = data_lines(cfg)
    if args.json:
        print(json.dumps({"config": str(args.config), **plan, **({"simulation": check} if check else {}),
                          "data": data}, indent=2))
    else:
        print(render_config_text(plan, str(args.config)))
        print("\ndata (qarl preflight checks the same):\n" + "\n".join(f"  {line}" for line in data))
        if check:
            print(render_simulation_text(check))
    return 0


def data_lines(cfg) -> list[str]:
    """Each prompt source the run reads, checked as ``qarl preflight`` does (``preflight.data``): where it is and its
    rows, or the problem naming the key and the path (docs/data.md makes the 30B configs' files)."""
    from megatron_qarl.preflight.data import check_sources

    return [f"{key}: {text}" if ok else f"{key}: MISSING: {text} (qarl data prepare, docs/data.md)"
            for key, ok, text in check_sources(cfg)]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``qarl`` parser."""
    parser = subparsers.add_parser("plan", help="per-GPU memory of learner and rollout layouts, and what fits",
                                   description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="Hugging Face model directory (config.json): every layout")
    source.add_argument("--config", type=Path, help="a run config: its learner and rollout layout")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (--config)")
    parser.add_argument("--scheme", default="w4a16", help=f"rollout / QAT scheme: {', '.join(SCHEMES)} (w4a16)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="cluster sizes in nodes (2 4)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (8)")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help=f"GPU memory in GiB (default: launch.gpu_gib, else {H100_GIB:.2f}: H100 80GB; "
                             f"{H200_GIB:.2f}: H200 141GB)")
    what_if = "what if (default: the config's learner.* keys; --model: the recipe's)"
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help=f"{what_if}: learner micro-batch tokens per DP rank (default: learner.micro_batch_size "
                             "full-length sequences; --model: one)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8, help="SGLang mem_fraction_static (0.8)")
    parser.add_argument("--recompute", choices=RECOMPUTES, default=None, help=f"{what_if}: activation recompute")
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help=f"{what_if}: Adam states sharded over DP")
    parser.add_argument("--optimizer-cpu-offload", action=argparse.BooleanOptionalAction, default=None,
                        help=f"{what_if}: optimizer states on the host (learner.optimizer_offload_fraction)")
    parser.add_argument("--attention", choices=ATTENTIONS, default=None,
                        help=f"{what_if}: flash (TE spec), sdpa (local spec, torch's fused attention) or unfused "
                             "(local spec, Megatron's DotProductAttention); default: from model.impl, model.attention "
                             "and where the learner runs")
    parser.add_argument("--simulate", action="store_true",
                        help="--config: also simulate one learner rank at full width on a shape-only simulated CUDA "
                             "device (megatron_qarl.plan.simulate; minutes) and set its figures beside the plan's")
    parser.add_argument("--simulate-layers", type=int, nargs="+", default=[2, 4], metavar="L",
                        help="layer counts simulated (2 4): the first two are extrapolated to the model's layers; "
                             "a third checks the extrapolation")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``qarl plan``; bad input becomes a UserError (exit code 2)."""
    _check_flags(args)
    if args.config is not None:
        return _run_config(args)
    if args.overrides:
        raise UserError(f"key=value overrides ({' '.join(args.overrides)}) need --config")
    if args.simulate:
        raise UserError("--simulate needs --config (it simulates that run's learner layout)")
    if args.scheme not in SCHEMES:
        raise UserError(f"--scheme: unknown scheme {args.scheme!r}; valid: {', '.join(SCHEMES)}")
    if not args.model.is_dir():
        raise UserError(f"--model: {args.model} is not a directory")
    cfg = recipe_config(args.model, args.scheme, args.mem_fraction_static)
    plan = make_plan(cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                     opts=_options(args, args.gpu_gib or H100_GIB))
    if args.json:
        print(json.dumps({"model": str(args.model), **plan}, indent=2))
    else:
        print(render_text(plan, str(args.model)))
    return 0

