"""The plan of a run: per-GPU memory of the learner and the rollout servers for a config's layout (``config_plan``)
or for every layout of a cluster (``make_plan``), and which fit a GPU.

Every plan is made from a run's typed config (``megatron_qarl.config.QarlConfig``): its model, quant scheme, step
shapes (train.prompts_per_step x rollout.sampling.n_samples responses of data.max_prompt_tokens +
rollout.sampling.max_new_tokens tokens), the learner's memory settings (learner.micro_batch_size,
distributed_optimizer, optimizer_cpu_offload, recompute; its attention from model.impl: ``learner_attention``) and
SGLang mem_fraction_static. ``config_plan`` plans that run: its learner layout (parallel.*, world_size ranks), its
rollout servers (rollout.servers x gpus_per_server, SGLang --tp-size), whether each fits the GPU, and which other
layouts of its launch.nodes x gpus_per_node GPUs fit. ``recipe_config`` is the public Qwen3-30B-A3B recipe's step
(``RECIPE``) for a model and scheme.

For every cluster of ``nodes`` x ``gpus_per_node`` GPUs ``make_plan`` tries each placement (learner and rollout
colocated on all GPUs, or split: learner on a nodes, rollout servers on the others), every learner layout
(TP in 1, 2, 4, 8 with sequence parallel when TP > 1, EP dividing the experts and the GPU count) and every
rollout server layout (one server per TP GPUs inside a node, EP dividing TP), and reports the memory of each
(formulas in ``megatron_qarl.plan.memory``) and whether it fits. What a run config does not say, the GPU and the
what-if learner options, is ``PlanOptions``. The text of a plan is ``plan.render``'s; the command ``plan.cli``'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import UserError
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.memory import (
    ATTENTIONS,
    GIB,
    RECOMPUTES,
    LayoutError,
    LearnerLayout,
    ServerLayout,
    check_learner_layout,
    learner_memory,
    micro_batch_sequences,
    optimizer_host_bytes,
    param_counts,
    rollout_memory,
    rollout_weight_bytes,
    step_shape,
    weight_summary,
)
from megatron_qarl.plan.step import train_activations
from megatron_qarl.plan.verdict import step_shape_of, verdict
from megatron_qarl.preflight.rules import validate_run
from megatron_qarl.qat.config import QuantConfig

TP_CHOICES = (1, 2, 4, 8)
H100_GIB = 81559 / 1024  # an H100 SXM "80GB" as the driver reports it: 81559 MiB
H200_GIB = 143771 / 1024  # an H200 SXM "141GB" as nvidia-smi reports it: 143771 MiB


# ``qarl plan --model``: the step of a public Qwen3-30B-A3B GRPO recipe (32 prompts x 8 samples, prompt 1024 +
# response 8192 tokens), the learner running one full-length sequence per forward/backward
RECIPE = {
    "train": {"prompts_per_step": 32},
    "data": {"max_prompt_tokens": 1024},
    "rollout": {"sampling": {"n_samples": 8, "max_new_tokens": 8192}},
    "learner": {"micro_batch_size": 1},
    "launch": {"gpus_per_learner_rank": 1},  # a GPU learner (its attention: see learner_attention)
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What a plan needs beyond the run config, and what-if overrides of it. ``gpu_gib``: memory the driver
    reports; a learner layout fits when its step's peak phase and the GPU's itemised fixed costs
    (``plan.fixed_costs``) fit it. Every learner option left None is the config's own (``learner_settings``):
    ``micro_batch_tokens`` (tokens per data-parallel rank, else learner.micro_batch_size sequences),
    ``distributed_optimizer``, ``optimizer_cpu_offload``, ``recompute`` (none / selective / full), ``attention``
    (flash / unfused, else ``learner_attention``). ``te_available``: whether transformer_engine is installed where
    the learner runs (None: assumed on GPU nodes). ``expert_imbalance``: the busiest rank's routed tokens over the
    balanced share."""

    gpu_gib: float = H100_GIB
    micro_batch_tokens: int | None = None
    distributed_optimizer: bool | None = None
    optimizer_cpu_offload: bool | None = None
    recompute: str | None = None
    attention: str | None = None
    te_available: bool | None = None
    expert_imbalance: float = 1.0


def learner_attention(cfg: QarlConfig, te_available: bool | None = None) -> tuple[str, str]:
    """(the learner's attention as the planner counts it, why): ``flash`` for Transformer Engine's fused
    attention (the TE spec); on Megatron's local spec, ``sdpa`` for torch's fused attention (moe/attention.py, no
    s^2 scores) or ``unfused`` for Megatron's DotProductAttention (the s^2 scores in memory), as model.attention
    says (``local_spec_attention``). model.impl te / local decide the spec; auto is the TE spec where
    transformer_engine imports (``moe.te.resolve_impl``), which needs CUDA: the local spec for a CPU run
    (``QarlConfig.gpu_run_keys`` empty), where ``te_available`` is False, or where model.attention names a local-spec
    attention; the TE spec on GPUs otherwise (``te_available`` None: TE assumed installed on the GPU nodes)."""
    impl, local = cfg.model.impl, local_spec_attention(cfg)
    what = (f"model.attention={cfg.model.attention}: torch's fused attention, no s^2 scores" if local == "sdpa" else
            "model.attention=unfused: Megatron's DotProductAttention, s^2 scores in memory")
    if impl == "te":
        return "flash", "model.impl=te: Transformer Engine's fused attention"
    if impl == "local":
        return local, f"model.impl=local: Megatron's local spec, {what}"
    if cfg.model.attention != "auto":
        return local, f"model.impl=auto with {what}: Megatron's local spec"
    if not cfg.learner_on_gpus:
        return local, f"model.impl=auto in a CPU run: the local spec, {what}"
    if te_available is False:
        return local, f"model.impl=auto without transformer_engine: the local spec, {what}"
    return "flash", ("model.impl=auto on GPUs with transformer_engine: the TE spec" if te_available else
                     "model.impl=auto on GPUs: the TE spec, assuming transformer_engine is installed there")


def local_spec_attention(cfg: QarlConfig) -> str:
    """The core attention the learner builds on Megatron's local spec (``moe.attention.resolve_attention``): "sdpa"
    or "unfused"; what ``plan.simulate`` runs (the local spec, whatever model.impl says)."""
    return "unfused" if cfg.model.attention == "unfused" else "sdpa"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerSettings:
    """The learner's memory settings a plan uses: the config's (learner.*), or ``PlanOptions``' overrides."""

    distributed_optimizer: bool
    offload_fraction: float  # of the optimizer shard kept on the host (0: no CPU offload)
    recompute: str
    recompute_num_layers: int
    attention: str
    attention_why: str


def learner_settings(cfg: QarlConfig, opts: PlanOptions) -> LearnerSettings:
    """``opts``' overrides, else the config's learner memory settings; UserError naming the flag on a
    combination Megatron cannot build."""
    le = cfg.learner
    dist_opt = le.distributed_optimizer if opts.distributed_optimizer is None else opts.distributed_optimizer
    offload = le.optimizer_cpu_offload if opts.optimizer_cpu_offload is None else opts.optimizer_cpu_offload
    if offload and not dist_opt:
        raise UserError("--no-distributed-optimizer: optimizer CPU offload (learner.optimizer_cpu_offload or "
                        "--optimizer-cpu-offload) needs the distributed optimizer")
    if opts.recompute not in (None, *RECOMPUTES):
        raise UserError(f"--recompute: {opts.recompute!r} is not one of {', '.join(RECOMPUTES)}")
    if opts.attention not in (None, *ATTENTIONS):
        raise UserError(f"--attention: {opts.attention!r} is not one of {', '.join(ATTENTIONS)}")
    attention, why = learner_attention(cfg, opts.te_available)
    if opts.attention is not None:
        attention, why = opts.attention, "--attention"
    return LearnerSettings(distributed_optimizer=dist_opt, offload_fraction=le.optimizer_offload_fraction if offload
                           else 0.0, recompute=opts.recompute or le.recompute,
                           recompute_num_layers=le.recompute_num_layers, attention=attention, attention_why=why)


def recipe_config(model: str | Path, scheme: str, mem_fraction_static: float = 0.8) -> QarlConfig:
    """The run config ``qarl plan --model`` plans: ``RECIPE`` for ``model`` in ``scheme``."""
    data = json.loads(json.dumps(RECIPE))
    data["rollout"]["mem_fraction_static"] = mem_fraction_static
    return validate_run({**data, "model": {"path": str(model)}, "quant": {"scheme": scheme}})


def micro_batch_tokens(cfg: QarlConfig, dp: int, opts: PlanOptions) -> int:
    """Tokens of one learner forward/backward on a data-parallel rank: ``opts.micro_batch_tokens``, else
    ``micro_batch_sequences`` full-length sequences."""
    return opts.micro_batch_tokens or micro_batch_sequences(cfg, dp) * step_shape(cfg)[1]


def _gib(x: float) -> float:
    return round(x / GIB, 2)


def learner_rows(cfg: QarlConfig, arch: Qwen3MoeArch, gpus: int, opts: PlanOptions) -> tuple[list[dict], list[str]]:
    """(one row per runnable learner layout on ``gpus`` GPUs, reasons the other candidates were rejected)."""
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
            mem = _learner_memory(cfg, arch, lay, opts)
            v = _verdict(cfg, arch, lay, opts)
            rows.append({"tp": tp, "ep": ep, "etp": lay.etp, "dp": lay.dp, "edp": lay.edp, "sp": lay.sp,
                         **{f"{k}_gib": _gib(v) for k, v in mem.items()}, "peak_phase": v["peak_phase"],
                         "peak_gib": v["peak_gib"], "fixed_gib": v["fixed_gib"]["total"],
                         "margin_gib": v["margin_gib"], "fits": v["fits"]})
    return rows, sorted(set(rejected))


def _learner_memory(cfg: QarlConfig, arch: Qwen3MoeArch, lay: LearnerLayout, opts: PlanOptions) -> dict[str, float]:
    """The train step's memory by term: ``learner_memory``'s persistent terms and ``plan.step``'s activations."""
    st = learner_settings(cfg, opts)
    tokens = micro_batch_tokens(cfg, lay.dp, opts)
    mem = learner_memory(arch, cfg.quant, lay, micro_batch_tokens=tokens, seq_len=step_shape(cfg)[1],
                         attention=st.attention, distributed_optimizer=st.distributed_optimizer,
                         offload_fraction=st.offload_fraction, recompute=st.recompute,
                         recompute_num_layers=st.recompute_num_layers, expert_imbalance=opts.expert_imbalance)
    shape = dataclasses.replace(step_shape_of(cfg, tokens, step_shape(cfg)[1], st),
                                expert_imbalance=opts.expert_imbalance)
    mem["activations"] = int(train_activations(arch, lay, shape)["activations"])
    mem["total"] = sum(v for k, v in mem.items() if k != "total")
    return mem


def _verdict(cfg: QarlConfig, arch: Qwen3MoeArch, lay: LearnerLayout, opts: PlanOptions) -> dict:
    """``plan.verdict.verdict`` of ``lay`` with the config's (or the what-if) learner settings."""
    st = learner_settings(cfg, opts)
    shape = step_shape_of(cfg, micro_batch_tokens(cfg, lay.dp, opts), step_shape(cfg)[1], st)
    return verdict(cfg, arch, lay, shape, opts.gpu_gib, opts.expert_imbalance)


def _rollout_memory(cfg: QarlConfig, arch: Qwen3MoeArch, srv: ServerLayout, seqs: int, opts: PlanOptions):
    return rollout_memory(arch, cfg.quant, srv, gpu_bytes=int(opts.gpu_gib * GIB),
                          mem_fraction_static=cfg.rollout.mem_fraction_static, concurrent_seqs=seqs,
                          seq_len=step_shape(cfg)[1], kv_cache_dtype=cfg.rollout.kv_cache_dtype)


def _rollout_cells(mem) -> dict:
    return {"weights_gib": _gib(mem.weights), "overhead_gib": _gib(mem.overhead),
            "kv_pool_gib": _gib(max(mem.kv_pool, 0)), "kv_needed_gib": _gib(mem.kv_needed), "kv_tokens": mem.kv_tokens,
            "seqs_at_full_length": mem.seqs_at_full_length, "fits": mem.fits, "fits_all": mem.fits_all}


def rollout_rows(cfg: QarlConfig, arch: Qwen3MoeArch, gpus: int, gpus_per_node: int,
                 opts: PlanOptions) -> tuple[list[dict], list[str]]:
    """(one row per runnable SGLang server layout on ``gpus`` GPUs, reasons for rejected candidates)."""
    rows, rejected = [], []
    for tp in TP_CHOICES:
        if tp > gpus_per_node or gpus % tp:
            continue
        servers = gpus // tp
        seqs = math.ceil(step_shape(cfg)[0] / servers)
        for ep in (e for e in TP_CHOICES if e <= tp and tp % e == 0):
            try:
                mem = _rollout_memory(cfg, arch, ServerLayout(tp=tp, ep=ep), seqs, opts)
            except LayoutError as err:
                rejected.append(str(err))
                continue
            rows.append({"tp": tp, "ep": ep, "moe_tp": tp // ep, "servers": servers, "seqs_per_server": seqs,
                         **_rollout_cells(mem)})
    return rows, sorted(set(rejected))


def placements(nodes: int) -> list[tuple[str, int, int]]:
    """(name, learner nodes, rollout nodes): colocated on all nodes, or split a + (nodes - a)."""
    out = [("colocated", nodes, nodes)]
    out += [(f"split {a}+{nodes - a}", a, nodes - a) for a in range(1, nodes)]
    return out


def _checkpoint_gib(arch: Qwen3MoeArch, quant: QuantConfig) -> dict[str, float]:
    return {"bf16": _gib(rollout_weight_bytes(arch, QuantConfig())),
            quant.scheme: _gib(rollout_weight_bytes(arch, quant))}


def make_plan(cfg: QarlConfig, *, nodes: Sequence[int], gpus_per_node: int, opts: PlanOptions) -> dict:
    """Every placement and layout of ``cfg``'s step on clusters of ``nodes`` x ``gpus_per_node`` GPUs, as a
    JSON-ready dict (``qarl plan --model --json`` prints it)."""
    arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
    gpn = gpus_per_node
    clusters = []
    for n in nodes:
        rows = []
        for name, ln, rn in placements(n):
            learner, l_rej = learner_rows(cfg, arch, ln * gpn, opts)
            rollout, r_rej = rollout_rows(cfg, arch, rn * gpn, gpn, opts)
            rows.append({"placement": name, "learner_gpus": ln * gpn, "rollout_gpus": rn * gpn,
                         "learner": learner, "rollout": rollout, "rejected": l_rej + r_rej,
                         "fits": any(r["fits"] for r in learner) and any(r["fits"] for r in rollout)})
        clusters.append({"nodes": n, "gpus_per_node": gpn, "placements": rows})
    s = cfg.rollout.sampling
    return {
        "scheme": cfg.quant.scheme,
        "params": param_counts(arch),
        "rollout_checkpoint_gib": _checkpoint_gib(arch, cfg.quant),
        "config": {
            "workload": {"prompts_per_step": cfg.train.prompts_per_step, "samples_per_prompt": s.n_samples,
                         "prompt_len": cfg.data.max_prompt_tokens, "max_response_len": s.max_new_tokens,
                         "micro_batch_tokens": opts.micro_batch_tokens},
            "cluster": {"nodes": list(nodes), "gpus_per_node": gpn, "gpu_gib": opts.gpu_gib,
                        "mem_fraction_static": cfg.rollout.mem_fraction_static},
            "learner": {**dataclasses.asdict(learner_settings(cfg, opts)), "expert_imbalance": opts.expert_imbalance},
        },
        "clusters": clusters,
    }


# ------------------------------------------------------------------------------------------ --config
def config_plan(cfg: QarlConfig, opts: PlanOptions, *, alternatives: bool = True) -> dict:
    """Per-GPU memory of one run config: its learner layout (parallel.*, world_size ranks) with its memory settings
    (``learner_settings``) and its rollout servers (rollout.servers x gpus_per_server), whether each fits an
    ``opts.gpu_gib`` GPU, and (``alternatives``) which other layouts of ``launch.nodes`` x
    ``launch.gpus_per_node`` GPUs fit (``make_plan``)."""
    arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
    r = cfg.rollout
    sequences, seq_len = step_shape(cfg)
    lay = LearnerLayout(gpus=cfg.world_size, tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    st = learner_settings(cfg, opts)
    mem = _learner_memory(cfg, arch, lay, opts)
    step = _verdict(cfg, arch, lay, opts)
    host = optimizer_host_bytes(arch, lay, st.offload_fraction)
    learner = {"gpus": lay.gpus, "tp": lay.tp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp, "edp": lay.edp,
               "sp": lay.sp, "micro_batch_tokens": micro_batch_tokens(cfg, lay.dp, opts),
               "micro_batch_sequences": None if opts.micro_batch_tokens else micro_batch_sequences(cfg, lay.dp),
               "sequences_per_dp_rank": sequences // lay.dp,
               **{f"{k}_gib": _gib(v) for k, v in mem.items()}, "fits": step["fits"],
               "optimizer_host_gib_per_rank": _gib(host), "step": step}
    srv = ServerLayout(tp=max(r.gpus_per_server, 1), ep=r.ep_size)
    seqs = min(r.max_batch_size, math.ceil(sequences / r.servers))
    rollout = {"servers": r.servers, "gpus_per_server": r.gpus_per_server, "tp": srv.tp, "seqs_per_server": seqs,
               "kv_cache_dtype": r.kv_cache_dtype, **_rollout_cells(_rollout_memory(cfg, arch, srv, seqs, opts))}
    la = cfg.launch
    checkpoint = _checkpoint_gib(arch, cfg.quant)
    plan = {
        "scheme": cfg.quant.scheme,
        "params": param_counts(arch),
        "rollout_checkpoint_gib": checkpoint,
        "gpu_gib": round(opts.gpu_gib, 2),
        "cluster": {"nodes": la.nodes, "gpus_per_node": la.gpus_per_node,
                    "gpus_used": lay.gpus + r.servers * r.gpus_per_server},
        "workload": {"sequences": sequences, "seq_len": seq_len},
        "learner_options": dataclasses.asdict(st),
        "learner": learner,
        "rollout": rollout,
        "fits": learner["fits"] and rollout["fits"],
        "sync": sync_estimate(arch, cfg.quant, lay, la.gpus_per_node or 8),
    }
    if alternatives:
        others = make_plan(cfg, nodes=(la.nodes,), gpus_per_node=la.gpus_per_node or 8, opts=opts)
        plan["alternatives"] = [
            {"placement": pl["placement"], "learner_gpus": pl["learner_gpus"], "rollout_gpus": pl["rollout_gpus"],
             "fits": pl["fits"], "learner_fit": [f"tp{x['tp']}/ep{x['ep']}" for x in pl["learner"] if x["fits"]],
             "rollout_fit": [f"tp{x['tp']}/ep{x['ep']}" for x in pl["rollout"] if x["fits"]]}
            for pl in others["clusters"][0]["placements"]]
    return plan


def sync_estimate(arch: Qwen3MoeArch, quant: QuantConfig, lay: LearnerLayout, gpus_per_node: int) -> dict:
    """The weight sync's payload (the rollout checkpoint's bytes, ``rollout_weight_bytes``; its low-bit share) and
    ``plan.sync``'s seconds of a full and a delta sync over each stated link."""
    from megatron_qarl.plan.sync import sync_table

    summary = weight_summary(arch, quant)
    payload = rollout_weight_bytes(arch, quant)
    low_bit = sum(ks.bytes - 2 * (ks.numel - ks.q_numel) for ks in summary.values() if ks.q_numel)
    return {"payload_gib": _gib(payload), "low_bit_gib": _gib(low_bit),
            "rows": sync_table(payload, low_bit, [lay], gpus_per_node=gpus_per_node)}


def simulation_check(cfg: QarlConfig, opts: PlanOptions, layers: Sequence[int] = (2, 4)) -> dict:
    """``qarl plan --simulate``: ``plan.simulate``'s simulation of one learner rank (every phase, at ``layers`` layers,
    extrapolated to the model's) beside the planner's figures, term by term (``plan.sim_check.compare``). The
    simulation runs Megatron's local spec (Transformer Engine is not installed where it runs), so the planner is
    asked for that spec's attention (``local_spec_attention``: sdpa or unfused, as model.attention says)."""
    from megatron_qarl.plan.simulate import simulate_config

    sim = simulate_config(cfg, layers=tuple(layers))
    return {"layout": {"gpus": cfg.world_size, "tp": cfg.parallel.tp, "ep": cfg.parallel.ep}, "simulation": sim,
            **check_against_plan(cfg, opts, sim)}


def check_against_plan(cfg: QarlConfig, opts: PlanOptions, sim: dict) -> dict:
    """``plan.sim_check.compare`` of a saved or fresh simulation of ``cfg`` with this checkout's planner, asked for
    the attention the simulation ran (``local_spec_attention``)."""
    from megatron_qarl.plan.sim_check import compare

    arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
    lay = LearnerLayout(gpus=cfg.world_size, tp=cfg.parallel.tp, ep=cfg.parallel.ep)
    st = learner_settings(cfg, opts)
    shape = step_shape_of(cfg, micro_batch_tokens(cfg, lay.dp, opts), step_shape(cfg)[1], st)
    return compare(arch, cfg.quant, lay, dataclasses.replace(shape, attention=local_spec_attention(cfg)), sim)

