"""``qarl plan``: per-GPU memory of the learner and the rollout servers, and which layouts fit a GPU.

    qarl plan --model DIR [--scheme S] [--nodes 2 4] [--gpus-per-node 8] [--gpu-gib 79.65] [--json]
    qarl plan --config C [key.sub=value ...] [--gpu-gib 79.65] [--json]

With ``--config`` it plans that run: its learner layout (parallel.*, world_size ranks), its rollout servers
(rollout.servers x gpus_per_server, SGLang --tp-size), the step's shapes (prompts x samples, prompt + response
tokens), whether each fits the GPU, and which other layouts of its launch.nodes x gpus_per_node GPUs fit.

For every cluster of ``nodes`` x ``gpus_per_node`` GPUs it tries each placement (learner and rollout
colocated on all GPUs, or split: learner on a nodes, rollout servers on the others), every learner layout
(TP in 1, 2, 4, 8 with sequence parallel when TP > 1, EP dividing the experts and the GPU count) and every
rollout server layout (one server per TP GPUs inside a node, EP dividing TP), and reports the memory of each
(formulas in ``megatron_qarl.plan``) and whether it fits. ``make_plan`` takes a typed ``PlanConfig`` so a
run config can feed it directly.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron_qarl.errors import UserError
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan import (
    GIB,
    LayoutError,
    LearnerLayout,
    ServerLayout,
    check_learner_layout,
    learner_memory,
    param_counts,
    rollout_memory,
    rollout_weight_bytes,
)
from megatron_qarl.qat.config import SCHEMES, QuantConfig

TP_CHOICES = (1, 2, 4, 8)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkloadConfig(_Section):
    """The RL step's shapes (defaults: the public Qwen3-30B-A3B recipe, 32 prompts x 8 samples)."""

    prompts_per_step: int = Field(default=32, ge=1)
    samples_per_prompt: int = Field(default=8, ge=1)
    prompt_len: int = Field(default=1024, ge=1)
    max_response_len: int = Field(default=8192, ge=1)
    # tokens of one learner micro-batch per data-parallel rank (shared by its TP group, split by SP);
    # None = one full-length sequence (prompt + max response), the least that holds a sequence without CP
    micro_batch_tokens: int | None = Field(default=None, ge=1)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_response_len

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_tokens or self.seq_len


class ClusterConfig(_Section):
    """GPUs. ``gpu_gib``: memory the driver reports (H100 SXM "80GB": 81559 MiB = 79.65 GiB); the learner keeps
    ``reserve_gib`` free (CUDA context, cuBLAS/NCCL buffers, allocator fragmentation); SGLang gives weights +
    KV ``mem_fraction_static`` of the GPU and keeps the rest for activations and CUDA graphs."""

    nodes: tuple[int, ...] = (2, 4)
    gpus_per_node: int = Field(default=8, ge=1)
    gpu_gib: float = Field(default=81559 / 1024, gt=0)
    reserve_gib: float = Field(default=2.0, ge=0)
    mem_fraction_static: float = Field(default=0.8, gt=0, lt=1)


class LearnerOptions(_Section):
    distributed_optimizer: bool = True
    recompute: bool = False  # full activation recompute
    expert_imbalance: float = Field(default=1.0, ge=1.0)  # busiest rank's routed tokens / the balanced share


class PlanConfig(_Section):
    workload: WorkloadConfig = WorkloadConfig()
    cluster: ClusterConfig = ClusterConfig()
    learner: LearnerOptions = LearnerOptions()


def _gib(x: float) -> float:
    return round(x / GIB, 2)


def learner_rows(arch: Qwen3MoeArch, quant: QuantConfig, gpus: int, cfg: PlanConfig) -> tuple[list[dict], list[str]]:
    """(one row per runnable learner layout on ``gpus`` GPUs, reasons the other candidates were rejected)."""
    usable = (cfg.cluster.gpu_gib - cfg.cluster.reserve_gib) * GIB
    rows, rejected = [], []
    eps = [e for e in range(1, arch.num_experts + 1) if arch.num_experts % e == 0 and e <= gpus]
    for tp in TP_CHOICES:
        for ep in eps:
            lay = LearnerLayout(gpus=gpus, tp=tp, ep=ep)
            try:
                check_learner_layout(arch, lay)
            except LayoutError as err:
                if gpus % (ep * lay.etp) == 0 and gpus % tp == 0:  # only report the non-obvious rejections
                    rejected.append(str(err))
                continue
            mem = learner_memory(arch, quant, lay, micro_batch_tokens=cfg.workload.tokens_per_micro_batch,
                                 **cfg.learner.model_dump())
            rows.append({"tp": tp, "ep": ep, "etp": lay.etp, "dp": lay.dp, "edp": lay.edp, "sp": lay.sp,
                         **{f"{k}_gib": _gib(v) for k, v in mem.items()}, "fits": mem["total"] <= usable})
    return rows, sorted(set(rejected))


def rollout_rows(arch: Qwen3MoeArch, quant: QuantConfig, gpus: int, cfg: PlanConfig) -> tuple[list[dict], list[str]]:
    """(one row per runnable SGLang server layout on ``gpus`` GPUs, reasons for rejected candidates)."""
    rows, rejected = [], []
    for tp in TP_CHOICES:
        if tp > cfg.cluster.gpus_per_node or gpus % tp:
            continue
        servers = gpus // tp
        seqs = math.ceil(cfg.workload.sequences / servers)
        for ep in (e for e in TP_CHOICES if e <= tp and tp % e == 0):
            try:
                mem = rollout_memory(arch, quant, ServerLayout(tp=tp, ep=ep), gpu_bytes=int(cfg.cluster.gpu_gib * GIB),
                                     mem_fraction_static=cfg.cluster.mem_fraction_static, concurrent_seqs=seqs,
                                     seq_len=cfg.workload.seq_len)
            except LayoutError as err:
                rejected.append(str(err))
                continue
            rows.append({"tp": tp, "ep": ep, "moe_tp": tp // ep, "servers": servers, "seqs_per_server": seqs,
                         "weights_gib": _gib(mem.weights), "overhead_gib": _gib(mem.overhead),
                         "kv_pool_gib": _gib(max(mem.kv_pool, 0)), "kv_needed_gib": _gib(mem.kv_needed),
                         "kv_tokens": mem.kv_tokens, "seqs_at_full_length": mem.seqs_at_full_length,
                         "fits": mem.fits, "fits_all": mem.fits_all})
    return rows, sorted(set(rejected))


def placements(nodes: int) -> list[tuple[str, int, int]]:
    """(name, learner nodes, rollout nodes): colocated on all nodes, or split a + (nodes - a)."""
    out = [("colocated", nodes, nodes)]
    out += [(f"split {a}+{nodes - a}", a, nodes - a) for a in range(1, nodes)]
    return out


def make_plan(arch: Qwen3MoeArch, quant: QuantConfig, cfg: PlanConfig) -> dict:
    """The whole plan as a JSON-ready dict (``qarl plan --json`` prints it)."""
    gpn = cfg.cluster.gpus_per_node
    clusters = []
    for nodes in cfg.cluster.nodes:
        rows = []
        for name, ln, rn in placements(nodes):
            learner, l_rej = learner_rows(arch, quant, ln * gpn, cfg)
            rollout, r_rej = rollout_rows(arch, quant, rn * gpn, cfg)
            rows.append({"placement": name, "learner_gpus": ln * gpn, "rollout_gpus": rn * gpn,
                         "learner": learner, "rollout": rollout, "rejected": l_rej + r_rej,
                         "fits": any(r["fits"] for r in learner) and any(r["fits"] for r in rollout)})
        clusters.append({"nodes": nodes, "gpus_per_node": gpn, "placements": rows})
    return {
        "scheme": quant.scheme,
        "params": param_counts(arch),
        "rollout_checkpoint_gib": {"bf16": _gib(rollout_weight_bytes(arch, QuantConfig())),
                                   quant.scheme: _gib(rollout_weight_bytes(arch, quant))},
        "config": cfg.model_dump(mode="json"),
        "clusters": clusters,
    }


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    def fmt(v) -> str:
        return "yes" if v is True else "no" if v is False else str(v)

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return ["    " + line for line in lines]


_LEARNER_COLS = ["tp", "ep", "etp", "dp", "edp", "weights_gib", "gradients_gib", "optimizer_gib", "activations_gib",
                 "qat_cache_gib", "total_gib", "fits"]
_ROLLOUT_COLS = ["tp", "ep", "moe_tp", "servers", "seqs_per_server", "weights_gib", "kv_pool_gib", "kv_needed_gib",
                 "kv_tokens", "seqs_at_full_length", "fits", "fits_all"]


def render_text(plan: dict, model: str) -> str:
    """The human-readable report of ``make_plan``'s dict."""
    p, c = plan["params"], plan["config"]
    w, cl, lo = c["workload"], c["cluster"], c["learner"]
    ckpt = ", ".join(f"{k} {v} GiB" for k, v in plan["rollout_checkpoint_gib"].items())
    out = [
        f"model {model}: {p['total'] / 1e9:.2f}B params ({p['active'] / 1e9:.2f}B active per token), scheme "
        f"{plan['scheme']}",
        f"rollout checkpoint: {ckpt}",
        f"GPU {cl['gpu_gib']:.2f} GiB (learner keeps {cl['reserve_gib']} GiB free; SGLang mem_fraction_static "
        f"{cl['mem_fraction_static']}); {w['prompts_per_step']} prompts x {w['samples_per_prompt']} samples, "
        f"prompt {w['prompt_len']} + response {w['max_response_len']} tokens, micro-batch "
        f"{w['micro_batch_tokens'] or w['prompt_len'] + w['max_response_len']} tokens per DP rank; "
        f"distributed optimizer {lo['distributed_optimizer']}, full recompute {lo['recompute']}",
    ]
    for cluster in plan["clusters"]:
        out.append(f"\n== {cluster['nodes']} x {cluster['gpus_per_node']} GPUs ==")
        for pl in cluster["placements"]:
            fit_l = [f"tp{r['tp']}/ep{r['ep']}" for r in pl["learner"] if r["fits"]]
            fit_r = [f"tp{r['tp']}/ep{r['ep']}" for r in pl["rollout"] if r["fits"]]
            out.append(f"\n{pl['placement']}: learner on {pl['learner_gpus']} GPUs, rollout on {pl['rollout_gpus']}"
                       f" GPUs -> {'FITS' if pl['fits'] else 'does not fit'}")
            out.append(f"  learner layouts that fit: {', '.join(fit_l) or 'none'}")
            out.append(f"  rollout layouts that fit: {', '.join(fit_r) or 'none'}")
            out.append("  learner (GiB per GPU):")
            out += _table(pl["learner"], _LEARNER_COLS)
            out.append("  rollout servers (per GPU):")
            out += _table(pl["rollout"], _ROLLOUT_COLS)
            out += [f"  rejected: {r}" for r in pl["rejected"]]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ --config
# The learner (learner.py) builds Megatron DDP with use_distributed_optimizer=False and no recompute, and runs a
# data-parallel rank's whole share of the step's responses in one forward/backward (no micro-batching).
LEARNER_DISTRIBUTED_OPTIMIZER = False


def config_plan(cfg, *, gpu_gib: float, reserve_gib: float = 2.0, micro_batch_tokens: int | None = None,
                distributed_optimizer: bool = LEARNER_DISTRIBUTED_OPTIMIZER, recompute: bool = False) -> dict:
    """Per-GPU memory of one run config (a ``QarlConfig``): its learner layout (parallel.*, world_size ranks)
    and its rollout servers (rollout.servers x gpus_per_server), whether each fits a ``gpu_gib`` GPU, and
    which other layouts of ``launch.nodes`` x ``launch.gpus_per_node`` GPUs fit (``make_plan``)."""
    arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
    quant, r, s = cfg.quant, cfg.rollout, cfg.rollout.sampling
    seq_len = cfg.data.max_prompt_tokens + s.max_new_tokens
    sequences = cfg.train.prompts_per_step * s.n_samples
    lay = LearnerLayout(gpus=cfg.world_size, tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    tokens = micro_batch_tokens or seq_len
    mem = learner_memory(arch, quant, lay, micro_batch_tokens=tokens, distributed_optimizer=distributed_optimizer,
                         recompute=recompute)
    usable = (gpu_gib - reserve_gib) * GIB
    learner = {"gpus": lay.gpus, "tp": lay.tp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp, "edp": lay.edp,
               "sp": lay.sp, "micro_batch_tokens": tokens, "sequences_per_dp_rank": sequences // lay.dp,
               **{f"{k}_gib": _gib(v) for k, v in mem.items()}, "fits": mem["total"] <= usable}
    srv = ServerLayout(tp=max(r.gpus_per_server, 1))
    seqs = min(r.max_batch_size, math.ceil(sequences / r.servers))
    rm = rollout_memory(arch, quant, srv, gpu_bytes=int(gpu_gib * GIB), mem_fraction_static=r.mem_fraction_static,
                        concurrent_seqs=seqs, seq_len=seq_len)
    rollout = {"servers": r.servers, "gpus_per_server": r.gpus_per_server, "tp": srv.tp, "seqs_per_server": seqs,
               "weights_gib": _gib(rm.weights), "overhead_gib": _gib(rm.overhead),
               "kv_pool_gib": _gib(max(rm.kv_pool, 0)), "kv_needed_gib": _gib(rm.kv_needed),
               "kv_tokens": rm.kv_tokens, "seqs_at_full_length": rm.seqs_at_full_length, "fits": rm.fits,
               "fits_all": rm.fits_all}
    la = cfg.launch
    gpn = la.gpus_per_node or 8
    others = make_plan(arch, quant, PlanConfig(
        workload=WorkloadConfig(prompts_per_step=cfg.train.prompts_per_step, samples_per_prompt=s.n_samples,
                                prompt_len=cfg.data.max_prompt_tokens, max_response_len=s.max_new_tokens,
                                micro_batch_tokens=micro_batch_tokens),
        cluster=ClusterConfig(nodes=(la.nodes,), gpus_per_node=gpn, gpu_gib=gpu_gib, reserve_gib=reserve_gib,
                              mem_fraction_static=r.mem_fraction_static),
        learner=LearnerOptions(distributed_optimizer=distributed_optimizer, recompute=recompute)))
    return {
        "scheme": quant.scheme,
        "params": param_counts(arch),
        "rollout_checkpoint_gib": others["rollout_checkpoint_gib"],
        "gpu_gib": round(gpu_gib, 2), "reserve_gib": reserve_gib,
        "cluster": {"nodes": la.nodes, "gpus_per_node": la.gpus_per_node,
                    "gpus_used": lay.gpus + r.servers * r.gpus_per_server},
        "workload": {"sequences": sequences, "seq_len": seq_len},
        "learner_options": {"distributed_optimizer": distributed_optimizer, "recompute": recompute},
        "learner": learner,
        "rollout": rollout,
        "fits": learner["fits"] and rollout["fits"],
        "alternatives": [{"placement": pl["placement"], "learner_gpus": pl["learner_gpus"],
                          "rollout_gpus": pl["rollout_gpus"], "fits": pl["fits"],
                          "learner_fit": [f"tp{x['tp']}/ep{x['ep']}" for x in pl["learner"] if x["fits"]],
                          "rollout_fit": [f"tp{x['tp']}/ep{x['ep']}" for x in pl["rollout"] if x["fits"]]}
                         for pl in others["clusters"][0]["placements"]],
    }


def render_config_text(plan: dict, config: str) -> str:
    p, le, ro, cl = plan["params"], plan["learner"], plan["rollout"], plan["cluster"]
    ckpt = ", ".join(f"{k} {v} GiB" for k, v in plan["rollout_checkpoint_gib"].items())
    gpus = f"{cl['nodes']} x {cl['gpus_per_node']} GPUs" if cl["gpus_per_node"] else "CPU nodes"
    lo = plan["learner_options"]
    out = [
        f"config {config}: {p['total'] / 1e9:.2f}B params, scheme {plan['scheme']}, {gpus}; per GPU of "
        f"{plan['gpu_gib']} GiB",
        f"rollout checkpoint: {ckpt}",
        f"\nlearner: {le['gpus']} ranks, tp{le['tp']} (sequence parallel {'on' if le['sp'] else 'off'}) ep{le['ep']} "
        f"etp{le['etp']}, dense DP {le['dp']}, expert DP {le['edp']}; distributed optimizer "
        f"{lo['distributed_optimizer']}, recompute {lo['recompute']}; activations of a {le['micro_batch_tokens']}-"
        f"token micro-batch",
        f"  weights {le['weights_gib']} + gradients {le['gradients_gib']} + optimizer {le['optimizer_gib']} + "
        f"activations {le['activations_gib']} + qat cache {le['qat_cache_gib']} = {le['total_gib']} GiB "
        f"(usable {plan['gpu_gib'] - plan['reserve_gib']:.2f}) -> {'FITS' if le['fits'] else 'DOES NOT FIT'}",
        f"\nrollout: {ro['servers']} servers x {ro['gpus_per_server']} GPU (SGLang --tp-size {ro['tp']}), "
        f"{ro['seqs_per_server']} sequences of up to {plan['workload']['seq_len']} tokens each",
        f"  weights {ro['weights_gib']} GiB, KV pool {ro['kv_pool_gib']} GiB ({ro['kv_tokens']} tokens, "
        f"{ro['seqs_at_full_length']} full-length sequences; all {ro['seqs_per_server']} need "
        f"{ro['kv_needed_gib']} GiB), overhead {ro['overhead_gib']} GiB -> "
        f"{'FITS' if ro['fits'] else 'DOES NOT FIT'}"
        f"{'' if ro['fits_all'] or not ro['fits'] else ' (some requests queue)'}",
        f"\n=> {'FITS' if plan['fits'] else 'DOES NOT FIT'} on {plan['gpu_gib']} GiB GPUs",
        f"note: the learner today runs a data-parallel rank's whole share ({le['sequences_per_dp_rank']} sequences) "
        "in one forward/backward; the activations above assume micro-batches of "
        f"{le['micro_batch_tokens']} tokens",
        f"\nlayouts of {cl['nodes']} x {cl['gpus_per_node'] or 8} GPUs that fit (qarl plan --model for the tables):",
    ]
    for alt in plan["alternatives"]:
        out.append(f"  {alt['placement']}: learner on {alt['learner_gpus']}, rollout on {alt['rollout_gpus']} -> "
                   f"{'FITS' if alt['fits'] else 'does not fit'}; learner {', '.join(alt['learner_fit']) or 'none'}"
                   f"; rollout {', '.join(alt['rollout_fit']) or 'none'}")
    return "\n".join(out)


def _run_config(args: argparse.Namespace) -> int:
    from megatron_qarl.config import load_config

    cfg = load_config(args.config, args.overrides)
    plan = config_plan(cfg, gpu_gib=args.gpu_gib, micro_batch_tokens=args.micro_batch_tokens,
                       distributed_optimizer=args.distributed_optimizer or LEARNER_DISTRIBUTED_OPTIMIZER,
                       recompute=args.recompute)
    if args.json:
        print(json.dumps({"config": str(args.config), **plan}, indent=2))
    else:
        print(render_config_text(plan, str(args.config)))
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``qarl`` parser."""
    parser = subparsers.add_parser("plan", help="per-GPU memory of learner and rollout layouts, and what fits",
                                   description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="Hugging Face model directory (config.json): every layout")
    source.add_argument("--config", type=Path, help="a run config: its learner and rollout layout")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (--config)")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="--config: Adam states sharded over DP (the learner does not shard them today)")
    parser.add_argument("--scheme", default="w4a16", help=f"rollout / QAT scheme: {', '.join(SCHEMES)} (w4a16)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="cluster sizes in nodes (2 4)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (8)")
    parser.add_argument("--gpu-gib", type=float, default=81559 / 1024, help="GPU memory in GiB (79.65: H100 80GB)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="learner micro-batch tokens per DP rank (default: prompt + max response)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8, help="SGLang mem_fraction_static (0.8)")
    parser.add_argument("--recompute", action="store_true", help="learner with full activation recompute")
    parser.add_argument("--no-distributed-optimizer", action="store_true", help="Adam states not sharded over DP")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``qarl plan``; bad input becomes a UserError (exit code 2)."""
    if args.config is not None:
        return _run_config(args)
    if args.overrides:
        raise UserError(f"key=value overrides ({' '.join(args.overrides)}) need --config")
    if args.scheme not in SCHEMES:
        raise UserError(f"--scheme: unknown scheme {args.scheme!r}; valid: {', '.join(SCHEMES)}")
    if not args.model.is_dir():
        raise UserError(f"--model: {args.model} is not a directory")
    arch = Qwen3MoeArch.from_model_dir(args.model)
    try:
        cfg = PlanConfig(
            workload=WorkloadConfig(micro_batch_tokens=args.micro_batch_tokens),
            cluster=ClusterConfig(nodes=tuple(args.nodes), gpus_per_node=args.gpus_per_node, gpu_gib=args.gpu_gib,
                                  mem_fraction_static=args.mem_fraction_static),
            learner=LearnerOptions(distributed_optimizer=not args.no_distributed_optimizer, recompute=args.recompute),
        )
    except ValidationError as err:
        first = err.errors()[0]
        raise UserError(f"--{str(first['loc'][-1]).replace('_', '-')}: {first['msg']}") from None
    if any(n < 1 for n in cfg.cluster.nodes):
        raise UserError(f"--nodes: each entry must be >= 1, got {list(cfg.cluster.nodes)}")
    plan = make_plan(arch, QuantConfig(scheme=args.scheme), cfg)
    if args.json:
        print(json.dumps({"model": str(args.model), **plan}, indent=2))
    else:
        print(render_text(plan, str(args.model)))
    return 0
