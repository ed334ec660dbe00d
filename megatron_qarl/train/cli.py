"""``qarl train --config C [--resume [CHECKPOINT]] [key.sub=value ...]``: the QaRL training job.

Validates the whole config first, refuses a GPU run that ``qarl plan`` says does not fit its GPUs
(``check_memory``) and a run whose environments are not ready (``qarl preflight`` without its round trip:
preflight/environments.py ``require_ready``; ``--no-preflight`` skips it), then writes it to
``<train.output_dir>/config.yaml``, prepares the rollout servers' starting checkpoint (the policy exported in
``quant.scheme``'s SGLang format, or the policy itself for bf16), launches learner ranks and servers
(launch.backend: ray or local) and runs the loop. Ends with a summary: start and final held-out accuracy and the
mean time of each phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import yaml

from megatron_qarl.cli import add_config_args
from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import UserError
from megatron_qarl.preflight.rules import load_config


def rollout_model_dir(cfg: QarlConfig) -> str:
    """The directory the servers load at start: the quantized export (made once per run) or the policy."""
    if not cfg.quant.enabled:
        return cfg.model.path
    from megatron_qarl.qat.export import quantize_checkpoint

    q = cfg.quant
    name = q.scheme if q.num_bits == 4 else f"{q.scheme}_{q.num_bits}bit"
    engine = "vllm" if cfg.rollout.backend == "vllm" else "sglang"  # vLLM's INT8 config.json differs
    out = Path(cfg.train.output_dir) / "rollout_init" / (name + ("_vllm" if engine == "vllm" else ""))
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        quantize_checkpoint(cfg.model.path, cfg.quant.scheme, tmp, group_size=cfg.quant.group_size,
                            symmetric=cfg.quant.symmetric, num_bits=cfg.quant.num_bits,
                            scale_bits=cfg.quant.scale_bits, engine=engine)
        os.replace(tmp, out)
    return str(out)


def gpu_gib(cfg: QarlConfig) -> float:
    """Memory of one GPU the run gets, in GiB: launch.gpu_gib, else what torch reports for this node's first GPU,
    else an H100 80GB (plan.layouts.H100_GIB)."""
    from megatron_qarl.plan.layouts import H100_GIB
    from megatron_qarl.plan.memory import GIB

    if cfg.launch.gpu_gib:
        return cfg.launch.gpu_gib
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return H100_GIB


def check_memory(cfg: QarlConfig, config: str = "this config") -> None:
    """Refuse (UserError with the plan's figures) a GPU run (``QarlConfig.gpu_run_keys``: its learner runs on GPUs)
    which ``qarl plan --config`` says does not fit them: the learner's micro-batch, optimizer and recompute
    settings as configured, its attention as model.impl resolves here (the TE spec's flash attention where
    transformer_engine imports, else the local spec's unfused one), and the rollout servers.
    launch.memory_check=false skips it. Nothing is started or written before it."""
    if not (cfg.learner_on_gpus and cfg.launch.memory_check):
        return
    from megatron_qarl.moe.te import transformer_engine_available
    from megatron_qarl.plan.layouts import PlanOptions, config_plan
    from megatron_qarl.plan.render import refusal

    opts = PlanOptions(gpu_gib=gpu_gib(cfg), te_available=transformer_engine_available())
    why = refusal(config_plan(cfg, opts, alternatives=False), config)
    if why:
        raise UserError(why)


EXIT_STOPPED = 75  # stopped early on SIGUSR1/SIGTERM with a checkpoint saved (EX_TEMPFAIL); --resume continues


def run(cfg: QarlConfig, *, resume: bool | str = False, progress: bool = True,
        stop: threading.Event | None = None, config: str = "this config", preflight: bool = True) -> dict[str, float]:
    """``resume``: True (``--resume``) continues from the newest checkpoint, a path (``--resume CHECKPOINT``) from
    that one. Before anything starts, the policy's directory and the checkpoint to resume are checked whole: a
    corrupt or incomplete one is a UserError naming the file (and, for a checkpoint, the newest older one that
    checks out)."""
    from megatron_qarl.learner.checkpoint import resume_point
    from megatron_qarl.moe.model_dir import check_model_dir

    check_memory(cfg, config)
    check_model_dir(cfg.model.path)
    if resume:
        resume = resume_point(Path(cfg.train.output_dir) / "checkpoints", resume)
    from megatron_qarl.preflight.data import require_data

    require_data(cfg)  # every prompt file the run reads exists and has its keys (the training set is read next)
    if preflight:  # the cheap part of `qarl preflight`: the environments, NCCL, TE, driver, the server command
        from megatron_qarl.preflight.environments import require_ready

        require_ready(cfg, config)
    from transformers import AutoTokenizer

    from megatron_qarl.data.prompts import PromptStream
    from megatron_qarl.train.trainer import Trainer, write_summary

    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    stream = PromptStream(cfg.data, tokenizer)  # a bad dataset fails here, naming file:line, before any launch
    if stream.skipped.count:
        print(f"data: skipped {stream.skipped.count} rows {stream.skipped.by_reason}, "
              f"e.g. {stream.skipped.examples[:3]}")
    model_dir = rollout_model_dir(cfg)
    started = time.perf_counter()
    if cfg.launch.backend == "ray":
        from megatron_qarl.launch.ray_launcher import RayCluster

        cluster = RayCluster(cfg, model_dir)
        learners, servers, closers = cluster.learners, cluster.servers, [cluster.learners.close, cluster.close]
    else:
        from megatron_qarl.launch.local import LocalLearnerRanks, LocalServers

        servers = LocalServers(cfg, model_dir, wait=False)  # they load while the learner is built
        try:
            learners = LocalLearnerRanks(cfg)
        except BaseException:
            servers.close()
            raise
        try:
            servers.wait_ready()
        except BaseException:
            learners.close()
            raise
        closers = [learners.close, servers.close]
    with contextlib.ExitStack() as stack:  # every closer runs (last pushed first) even when one before it raises
        for close in reversed(closers):
            stack.callback(close)
        trainer = Trainer(cfg, learners, servers, tokenizer=tokenizer, resume=resume, progress=progress,
                          stream=stream)
        stack.callback(trainer.close)
        summary = trainer.run(stop)
    summary["time/total_s"] = time.perf_counter() - started
    write_summary(out / "summary.json", summary)
    return summary


def _report(summary: dict[str, float], out: Path) -> str:
    rows = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else summary
    from megatron_qarl.train.tracking import read_metrics

    steps = [r for r in read_metrics(out / "metrics.jsonl") if "time/step_s" in r]
    lines = [f"output: {out}"]
    for key in ("start/eval/greedy_accuracy", "eval/greedy_accuracy", "start/eval/sampled_accuracy",
                "eval/sampled_accuracy"):
        if key in rows:
            lines.append(f"{key}: {rows[key]:.3f}")
    if steps:
        for phase in ("rollout", "reward", "logp", "update", "sync", "step"):
            vals = [r[f"time/{phase}_s"] for r in steps]
            lines.append(f"mean time/{phase}_s: {sum(vals) / len(vals):.3f}")
    lines.append(f"total: {rows.get('time/total_s', 0):.1f} s")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():  # a second signal: stop now (cleanup still runs)
            raise SystemExit(128 + signum)
        print(f"qarl train: {signal.Signals(signum).name}: stopping after the current step (again: now)", flush=True)
        stop.set()

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, on_signal)
    from megatron_qarl.train.trainer import StopRequested

    try:
        summary = run(cfg, resume=args.resume, progress=not args.no_progress and sys.stderr.isatty(), stop=stop,
                      config=str(args.config), preflight=not args.no_preflight)
    except StopRequested as err:
        print(f"qarl train: {err}", flush=True)
        return EXIT_STOPPED
    print(_report(summary, Path(cfg.train.output_dir)))
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="run QaRL training (learner + rollout servers)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                        help="continue from the newest checkpoint of the output dir, or from CHECKPOINT (a step_* "
                             "folder of it: a key.sub=value word is an override, never CHECKPOINT)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-preflight", action="store_true",
                        help="skip the environment checks of qarl preflight (run before anything is built)")
    add_config_args(parser)
    parser.set_defaults(func=_run)
    return parser
