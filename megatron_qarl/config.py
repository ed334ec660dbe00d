"""The run configuration: typed sections composed from each component's own config, loaded from
YAML with ``key.sub=value`` overrides and validated before any work starts.

    cfg = validate_config(apply_overrides(load_yaml("configs/cpu_default.yaml"), ["parallel.tp=2"]))

A run's config is loaded with ``preflight.rules.load_config``, which adds the rules between components (what
each rollout backend can serve, the planner's server layouts): this module imports neither. Every error is a
ConfigError whose message starts with the dotted key (``parallel.tp: ...``) and, for YAML problems, the file
and line.

Paths (``PATH_KEYS``): a relative path written in a config file is relative to that file's folder, one given on the
command line (``key=value``) or left at its default to the current directory; ``preflight.rules.load_config`` makes
them absolute (``resolve_paths``) before validation, so a run reads the same files from any working directory and
every process of it (Ray actors, Slurm nodes, a resumed run) sees absolute paths.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from megatron_qarl.algo.advantages import AdvantageConfig
from megatron_qarl.algo.policy_loss import PolicyLossConfig
from megatron_qarl.data.prompts import SYNTHETIC, PromptDataConfig
from megatron_qarl.data.reward import RewardConfig
from megatron_qarl.errors import ConfigError
from megatron_qarl.moe.parallelize import COLLECTIVE_TIMEOUT_S
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.rollout.manager import SamplingConfig
from megatron_qarl.utils.api_key import from_env as api_key_from_env


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads 1e-5 as a string (it wants 1.0e-5); accept the exponent forms people write."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+][0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(_Section):
    """The policy: a Hugging Face Qwen3-MoE directory, the learner's parameter dtype and Megatron layer spec.

    impl: ``local`` Megatron's local spec (CPU-safe), ``te`` its Transformer Engine spec (fused norm + linear, TE
        grouped-GEMM experts; needs transformer_engine, else the learner stops with an error naming this key),
        ``auto`` TE where transformer_engine imports on the learner's machine. The quantized schemes (w8a8_fp8
        too) run TE's GEMMs in BF16 on ModelOpt's fake-quant operands, the exported codes x scales.
    te_fp8: TE's blockwise FP8 GEMMs for the learner (Megatron fp8="e4m3", fp8_recipe="blockwise"): a speed option
        with model.impl te, for quant.scheme bf16 and w4a16 (``moe.te.check_te_fp8``): with w4a16 the experts'
        fake-quant GEMMs run with fp8 autocast off inside (ModelOpt's TE plugin refuses it) and attention in FP8,
        which the rollout computes in BF16 (docs/quantization.md, "FP8 on the TE spec"); the W8A8 schemes quantize
        every TE linear, leaving nothing to FP8.
    attention: the local spec's core attention (``moe/attention.py``): ``sdpa`` torch's fused
        scaled_dot_product_attention (flash kernels on CUDA and CPU, GQA without repeated K/V, no s^2 scores kept),
        ``unfused`` Megatron's DotProductAttention (s^2 scores in memory), ``auto`` = sdpa. An explicit sdpa / unfused
        makes model.impl auto build the local spec; with model.impl te it is refused (TE has its own fused attention).
        numerics=exact ignores it (its attention is numerics/exact.c's).
    experts: the local spec's routed experts (``moe.grouped.resolve_experts``, docs/training.md "Three expert
        implementations"): ``grouped`` one parameter per projection and two grouped matmuls per layer (moe/grouped.py),
        ``sequential`` Megatron's SequentialMLP (an MLP per expert, run one after another), ``auto`` grouped where
        torch's grouped matmul is bit-equal and fast (CPU; CUDA sm90 / sm100 with bfloat16 parameters), else
        sequential. The TE spec has TE's grouped experts: with model.impl te only auto is taken.
    """

    path: str
    dtype: Literal["float32", "bfloat16"] = "float32"
    impl: Literal["auto", "local", "te"] = "auto"
    te_fp8: bool = False
    attention: Literal["auto", "sdpa", "unfused"] = "auto"
    experts: Literal["auto", "sequential", "grouped"] = "auto"

    @field_validator("path")
    @classmethod
    def _resolve(cls, value: str) -> str:
        p = Path(value).expanduser().absolute()  # relative: the current directory's (module docstring, "Paths")
        if not (p / "config.json").is_file():
            raise ValueError(f"{value!r}: no Hugging Face config.json in {p}")
        return str(p.resolve())


class ParallelConfig(_Section):
    """Learner layout: tensor (TP), expert (EP) parallel sizes; sequence parallel follows TP > 1.
    ``world_size``: learner ranks (one GPU each on GPU nodes); None = lcm(tp, ep), one expert replica.
    More ranks add data parallelism: dense DP = world_size / tp, expert DP = world_size / (ep * etp)."""

    tp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    world_size: int | None = Field(default=None, ge=1)
    sequence_parallel: bool | None = None  # None: on when tp > 1 (Megatron requires it for MoE + TP)
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.tp > 1 and self.sequence_parallel is False:
            raise ValueError("sequence_parallel: must be on when tp > 1 (Megatron MoE with TP requires it)")
        return self


class OptimConfig(_Section):
    """Adam on the master weights (Megatron's optimizer)."""

    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
    clip_grad: float = Field(default=1.0, ge=0)  # 0 = off


class AlgoConfig(_Section):
    """The policy-gradient algorithm: advantage estimator and policy loss (algo/)."""

    advantage: AdvantageConfig = AdvantageConfig()
    loss: PolicyLossConfig = PolicyLossConfig()
    # R3: the servers return the experts they routed each token to and the learner's aligned and training
    # forwards replay them (Megatron's RouterReplay); routing_agreement alone only measures how often the
    # learner, routing on its own, agrees (both report routing/* metrics; servers need their R3 flag)
    routing_replay: bool = False
    routing_agreement: bool = False

    @property
    def wants_routes(self) -> bool:
        return self.routing_replay or self.routing_agreement


class LearnerConfig(_Section):
    """How the learner uses the quantizer, and how it fits in memory (``qarl plan`` counts each of these).

    aligned: true (QaRL) runs the learner's forward on the very low-bit weights the rollout servers hold
        (fake quant with a straight-through backward); false keeps a full-precision forward and quantizes
        only what is sent to the servers (quantized-rollout training; pair it with algo.loss.mismatch=tis).
    micro_batch_size: rows per forward/backward on a learner rank; gradients accumulate over micro-batches
        (None: the rank's whole share of the step at once).
    distributed_optimizer: Megatron's distributed optimizer: fp32 master weights and Adam moments sharded over
        the data-parallel ranks (dense parameters over DP, experts over expert DP).
    optimizer_cpu_offload: Megatron's optimizer CPU offload (HybridDeviceOptimizer, with the distributed
        optimizer): ``optimizer_offload_fraction`` of this rank's optimizer shard lives and steps on the host
        (CPU Adam). GPU learners only.
    refresh_kernel: what re-quantizes the weights after each optimizer step (same bits on every path): ``triton``
        one fused Triton kernel per scheme and weight stack (qat/triton_refresh.py; on a CPU learner only under
        Triton's interpreter, TRITON_INTERPRET=1, for testing), ``torch`` the reference quantizer's torch ops,
        ``auto`` Triton for CUDA weights where it imports and compile_quantizer is off, else torch.
    recompute: activation recompute (Megatron TransformerConfig): none; selective = the core attention
        (recompute_modules ["core_attn"]: the unfused attention's s^2 scores are not kept); full = every layer,
        keeping only the input of each chunk of ``recompute_num_layers`` layers (recompute_method uniform).
    """

    aligned: bool = True
    micro_batch_size: int | None = Field(default=None, ge=1)
    compile_quantizer: bool = False  # the per-step W4A16 re-quantization runs torch.compile'd: same bits, ~10x
    # faster after a one-off compile per process (tens of seconds; inductor needs a C++ compiler on CPU)
    refresh_kernel: Literal["auto", "torch", "triton"] = "auto"
    distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = Field(default=1.0, gt=0, le=1)
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.optimizer_cpu_offload and not self.distributed_optimizer:
            raise ValueError("optimizer_cpu_offload: needs learner.distributed_optimizer=true (Megatron offloads "
                             "through its precision-aware distributed optimizer)")
        if self.compile_quantizer and self.refresh_kernel == "triton":
            raise ValueError("refresh_kernel: triton and learner.compile_quantizer=true each choose the refresh's "
                             "kernel; keep one (auto with compile_quantizer runs the compiled one)")
        return self


class SyncConfig(_Section):
    """Weight sync from the learner to the rollout servers after every step."""

    bucket_mb: int = Field(default=512, ge=1)
    verify: bool = False  # servers report checksums of what they received; a difference fails the run
    delta: bool = False  # after a full sync, send only changed blocks (embedded servers; docs/rollout.md)
    # timeout_s: each stretch of learner rank 0's sync I/O (the preamble: health, the weight-update group, pause,
    # flush; a session's start; one bucket: its broadcast and every server's answer; a session's end); the other
    # ranks wait in the sync's own collectives for peer_wait_s (2 x timeout_s + 60 s; sync/transport.py)
    timeout_s: float = Field(default=300.0, gt=0)

    @property
    def peer_wait_s(self) -> float:
        """How long the learner ranks other than 0 may wait in one of the sync's collectives (sync/transport.py
        ``peer_wait_s``: 2 x timeout_s + CLEANUP_S + PEER_SLACK_S)."""
        from megatron_qarl.sync.transport import peer_wait_s

        return peer_wait_s(self.timeout_s)


class RolloutConfig(_Section):
    """The rollout servers and how they sample. They serve ``quant.scheme``'s weights (bf16: full precision).

    backend: ``embedded`` (``qarl serve``, CPU kernels), ``sglang`` (``python -m sglang.launch_server``, GPUs) or
        ``vllm`` (``python -m vllm.entrypoints.launchers.api_server.entry``: vLLM 0.32 on CPUs or GPUs, in its own
        environment, rollout/vllm_launcher.py; docs/rollout.md "vLLM").
    servers: how many; gpus_per_server is SGLang's --tp-size, vLLM's --tensor-parallel-size (0 on CPU).
    kv_cache_dtype: the servers' KV cache (SGLang's ``--kv-cache-dtype``, the embedded server's too; refused with vLLM):
        ``auto`` the compute dtype; ``fp8_e4m3`` / ``fp8_e5m2`` one byte per element, each key and value divided by
        its layer's scale and cast on write, times the scale on read (qat/kv_cache.py). With learner.aligned the
        learner's attention computes on the same rounded keys and values (docs/quantization.md "The KV cache").
        Its scales are 1.0: SGLang 0.5.23's Qwen3-MoE reads none (its attention has no KV-cache quant method, and it
        has no load_kv_cache_scales for --quantization-param-path; qat/kv_cache.py).

    server_python, launch_prefix: the environment the servers run in. Every launcher (launch/local.py, the Ray
    fleet's server actors, and so slurm/qarl.sbatch) starts a server as
    ``[*launch_prefix, server_python, "-m", <the backend's module>, ...]`` (launch/fleet.py ``server_command``).
    An inference engine pins its own torch and transformers (sglang[all]==0.5.23: torch==2.14.1, transformers==
    5.19.0), which cannot share the learner's environment (torch==2.13.0, transformers==5.24.0), so on a cluster
    the servers run in their own environment (docs/cluster.md, "Installing"): ``server_python`` is that
    environment's interpreter (None: the trainer's own, ``sys.executable``, as on CPU machines), ``launch_prefix``
    an optional wrapper such as ``["apptainer", "exec", "--nv", "/images/sglang.sif"]`` (server_python is then
    the interpreter inside it). Neither is specific to SGLang: the embedded server runs the same way (that
    environment then needs megatron_qarl), and a vLLM backend (servers in their own environment too) reuses both.
    At load only their form is checked (the config is loaded where the interpreter may not exist: the head
    node, ``qarl plan``, CI); whether it exists, is executable and can import the engine is checked on the node
    that starts each server, before it starts (launch/fleet.py ``check_server_interpreter``).
    """

    backend: Literal["embedded", "sglang", "vllm"] = "embedded"
    servers: int = Field(default=1, ge=1)
    gpus_per_server: int = Field(default=0, ge=0)
    ep_size: int = Field(default=1, ge=1)  # SGLang's --ep-size: experts over ep, each split over tp / ep
    dp_size: int = Field(default=1, ge=1)  # SGLang's --dp-size; must stay 1 (see _check_layout)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    max_batch_size: int = Field(default=128, ge=1)  # concurrent sequences per server (SGLang: --max-running-requests)
    threads: int | None = Field(default=None, ge=1)  # torch threads of an embedded server (None: all cores)
    mem_fraction_static: float = Field(default=0.8, gt=0, le=1)  # SGLang only
    sampling: SamplingConfig = SamplingConfig()
    timeout_s: float = Field(default=600.0, gt=0)
    retries: int = Field(default=2, ge=0)
    max_concurrency: int = Field(default=256, ge=1)
    restart_dead: bool = True  # restart a server that died (before the next sync); false: drop it
    startup_timeout_s: float = Field(default=300.0, gt=0)
    # the servers' API key; unset: $QARL_API_KEY (utils/api_key.py). Never dumped (config.yaml, checkpoints)
    api_key: str | None = Field(default_factory=api_key_from_env, exclude=True, repr=False)
    sync: SyncConfig = SyncConfig()
    server_python: str | None = None  # the servers' interpreter: an absolute path or a command name (PATH)
    launch_prefix: list[str] = []  # argv put before it (a container runtime); [] = none

    @field_validator("server_python")
    @classmethod
    def _interpreter_form(cls, v: str | None) -> str | None:
        if v is not None:
            _check_command(v, "rollout.server_python")
        return v

    @field_validator("launch_prefix")
    @classmethod
    def _prefix_form(cls, v: list[str]) -> list[str]:
        if any(not a.strip() for a in v):
            raise ValueError(f"every item must be a non-empty string, got {v!r}")
        if v:
            _check_command(v[0], "rollout.launch_prefix[0]")
        return v


def _check_command(cmd: str, key: str) -> None:
    """An executable to start on another node: an absolute path, or a bare name looked up on that node's PATH.
    A relative path would depend on the directory each launcher happens to run in."""
    if not cmd.strip() or cmd != cmd.strip():
        raise ValueError(f"{cmd!r} is not a command (empty, or with surrounding spaces)")
    if "/" in cmd and not cmd.startswith("/"):
        raise ValueError(f"{cmd!r} is a relative path; {key} must be an absolute path (servers start on other "
                         "nodes, in other directories) or a command name looked up on PATH")


class EvalConfig(_Section):
    """Held-out evaluation through the rollout servers: greedy accuracy, and sampled accuracy (mean over
    ``sampled_n`` samples per prompt). ``data`` None: the synthetic task's held-out problems."""

    every: int = Field(default=25, ge=0)  # steps; 0 = never (the start and the end are always evaluated)
    n: int = Field(default=200, ge=1)
    data: PromptDataConfig | None = None
    sampled_n: int = Field(default=2, ge=0)
    temperature: float = Field(default=1.0, gt=0)
    max_new_tokens: int = Field(default=48, ge=1)


class CheckpointConfig(_Section):
    """Megatron dist-checkpointing of model, optimizer, RNG, data position, step and weight version.

    optimizer_format: how the distributed optimizer's state is written (Megatron's distrib_optim_sharding_type;
        learner/checkpoint.py): ``dp_reshardable`` each data-parallel rank writes its own gradient buckets, in parallel
        (a resume may change the data-parallel size only); ``fully_reshardable`` per parameter, in model space, after
        gathering it over data parallelism at each save: a resume may also change model.experts (sequential <->
        grouped). The model's weights are model space in both."""

    every: int = Field(default=20, ge=0)  # steps; 0 = only at the end
    keep: int = Field(default=2, ge=1)
    optimizer_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"


class TrainConfig(_Section):
    """The loop: steps, batch, where outputs go, fault limits."""

    steps: int = Field(default=100, ge=1)
    prompts_per_step: int = Field(default=16, ge=1)
    output_dir: str = Field(default="runs/cpu_default", validate_default=True)  # made absolute (PATH_KEYS)
    max_nonfinite_in_row: int = Field(default=3, ge=1)  # a run of this many skipped steps ends the run
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    learner_threads: int | None = Field(default=None, ge=1)  # torch threads per learner rank (None: cores/ranks)
    # fault drill: these steps' loss is multiplied by NaN, so the step must be skipped and counted
    inject_nonfinite_steps: list[int] = []
    # write every response token's logp_old - logp_sampler to log_ratios/step_NNNNNN.npy (float32) at each
    # evaluation, covering the steps since the previous one (mismatch histograms; benchmarks/repro_mini.py)
    save_log_ratios: bool = False
    # asynchronous rollouts (megatron_qarl/train/pipeline.py; docs/training.md, 'Asynchronous rollouts'):
    # off: sequential; one_step: step t+1's rollouts are sampled while step t trains, the sync waits for them;
    # bounded: the servers keep sampling up to max_staleness steps ahead, a sync retracts running requests
    # (SGLang's pause_generation mode retract; with R3 it aborts them and each is continued as a new request) and
    # they continue under the new weights; a sample with a token more than max_staleness versions behind the
    # learner is regenerated, never trained on
    async_mode: Literal["off", "one_step", "bounded"] = Field(default="off", alias="async")
    # bounded: weight versions. 1: as fast as 2 where measured and never behind off seed by seed, where 2 was never
    # ahead (docs/training.md, "Bounded staleness at parity"); raise it for long-tailed responses
    max_staleness: int = Field(default=1, ge=1)
    # async modes: the servers rescore each batch at the learner's version, splitting the mismatch into its
    # staleness part (policy change) and its quantization part (learner vs server, same weights)
    mismatch_split: bool = True

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    @field_validator("output_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return str(Path(value).expanduser().absolute())  # relative: the current directory's (module docstring)

    @field_validator("async_mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare off as false

    @property
    def staleness_bound(self) -> int:
        """How many weight versions a trained sample may lag the learner: 0 off, 1 one_step, max_staleness."""
        return {"off": 0, "one_step": 1, "bounded": self.max_staleness}[self.async_mode]


class LaunchConfig(_Section):
    """Where the parts run. ``ray``: learner ranks and rollout servers are Ray actors in a placement group
    (``ray_address`` None starts a local Ray; ``auto`` joins the cluster the Slurm script started).
    ``local``: learner in this process (world size 1), servers as child processes."""

    backend: Literal["ray", "local"] = "ray"
    ray_address: str | None = None
    num_cpus: int | None = Field(default=None, ge=1)  # local Ray only (None: all cores)
    gpus_per_learner_rank: int = Field(default=0, ge=0)
    master_addr: str = "127.0.0.1"  # learner rank 0's address for its process group and the weight-update
    # group; "auto": rank 0's host address (multi-node)
    server_host: str = "127.0.0.1"  # where servers listen; not loopback: URLs use the node's address and the
    # admin endpoints require rollout.api_key
    # the cluster a GPU run is laid out for (slurm/qarl.sbatch asks Slurm for it); gpus_per_node 0: CPU nodes,
    # no GPU accounting. With GPUs: learner ranks * gpus_per_learner_rank + servers * rollout.gpus_per_server
    # must use every GPU of nodes * gpus_per_node, and a server must fit in one node.
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=0, ge=0)
    # memory of one GPU in GiB as the driver reports it (qarl plan --config, qarl train's memory check); None:
    # qarl train measures a GPU of its node (torch.cuda), qarl plan assumes an H100 80GB (79.65)
    gpu_gib: float | None = Field(default=None, gt=0)
    memory_check: bool = True  # qarl train refuses a GPU learner run that qarl plan says does not fit
    # every wait on another process is bounded, and the bounds nest (docs/cluster.md, "Every wait is bounded"):
    # rank_timeout_s: one call of every learner rank's Ray actor (setup: build + load, a step, a whole sync, a save);
    # past it the trainer raises a UserError naming the rank, the call and Ray's resources. Above every bound a rank
    # waits through inside one call: collective_timeout_s, checkpoint_timeout_s, rollout.sync's peer wait
    rank_timeout_s: float = Field(default=1800.0, gt=0)
    # collective_timeout_s: torch.distributed's learner groups (the default group and Megatron's, each exactly): a
    # collective whose peers do not join within it fails on gloo and NCCL alike, instead of NCCL's silent default.
    # The weight sync's collectives have their own bound (rollout.sync.timeout_s), the checkpoint's the next key
    collective_timeout_s: float = Field(default=COLLECTIVE_TIMEOUT_S, gt=0)
    # checkpoint_timeout_s: the learner groups' collectives while a checkpoint is saved or loaded (dist-checkpointing's
    # gathers and barriers wait for the slowest rank's writes or reads of its shards, e.g. on a shared file system)
    checkpoint_timeout_s: float = Field(default=1200.0, gt=0)

    @model_validator(mode="after")
    def _check_timeouts(self) -> LaunchConfig:
        for key, inner, why in (
                ("launch.collective_timeout_s", self.collective_timeout_s, "a rank stuck in a collective then fails "
                 "with torch's error naming the collective, not a Ray timeout"),
                ("launch.checkpoint_timeout_s", self.checkpoint_timeout_s, "a save or load is one call of the "
                 "ranks: a rank stuck in its collectives fails with torch's error first")):
            if self.rank_timeout_s <= inner:
                raise ConfigError(f"launch.rank_timeout_s: {self.rank_timeout_s:g} s must be above {key} ({inner:g} "
                                  f"s): {why}")
        return self


class QarlConfig(_Section):
    """A whole run."""

    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    quant: QuantConfig = QuantConfig()
    learner: LearnerConfig = LearnerConfig()
    optim: OptimConfig = OptimConfig()
    algo: AlgoConfig = AlgoConfig()
    data: PromptDataConfig = PromptDataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)  # built per config: it reads $QARL_API_KEY
    train: TrainConfig = TrainConfig()
    launch: LaunchConfig = LaunchConfig()
    seed: int = 1234
    # exact: the learner's forward and the embedded servers compute every token with megatron_qarl/numerics/ (the
    # same kernels, order and rounding points: log-probs equal bit for bit at any layout and batch; docs/numerics.md);
    # default: each side's fastest kernels (the mismatch is then ~1e-7 per token with float32 servers, ~3e-3 bf16)
    numerics: Literal["default", "exact"] = "default"

    @property
    def world_size(self) -> int:
        """Learner ranks: parallel.world_size, else lcm(tp, ep) (one data-parallel replica of the experts)."""
        return self.parallel.world_size or self.parallel.tp * self.parallel.ep // math.gcd(self.parallel.tp,
                                                                                            self.parallel.ep)

    @model_validator(mode="after")
    def _check_run(self) -> QarlConfig:
        if self.launch.backend == "local" and self.world_size > 1:
            raise ConfigError(f"launch.backend: 'local' runs one learner rank; parallel.tp={self.parallel.tp}, "
                              f"parallel.ep={self.parallel.ep} need {self.world_size} (use 'ray')")
        if not self.rollout.sampling.temperature > 0:
            raise ConfigError(f"rollout.sampling.temperature: {self.rollout.sampling.temperature} must be > 0 to "
                              "train: the learner divides its logits by the rollout's temperature, as SGLang's "
                              "returned log-probs are of the temperature-scaled logits")
        self._check_learner_memory_options()
        self._check_sync_bound()
        from megatron_qarl.moe.attention import check_attention
        from megatron_qarl.moe.te import check_te_fp8

        check_te_fp8(self.model.te_fp8, self.model.impl, self.quant.scheme)
        check_attention(self.model.attention, self.model.impl)
        if self.model.impl == "te" and self.model.experts != "auto":
            raise ConfigError(f"model.experts: {self.model.experts} chooses the local spec's experts, but model.impl "
                              "is te (Transformer Engine's grouped experts, TEGroupedMLP); use model.experts=auto or "
                              "model.impl=local")
        return self

    def _check_sync_bound(self) -> None:
        """A sync is one call of the learner ranks (launch.rank_timeout_s); inside it the ranks other than 0 wait in
        the sync's collectives up to rollout.sync's peer wait (2 x rollout.sync.timeout_s + 60 s), which must end
        first, so a slow server is named by the sync's SyncError, not by Ray's timeout."""
        peer, rank = self.rollout.sync.peer_wait_s, self.launch.rank_timeout_s
        if rank <= peer:
            raise ConfigError(f"launch.rank_timeout_s: {rank:g} s must be above the weight sync's peer wait {peer:g} s "
                              f"(2 x rollout.sync.timeout_s = 2 x {self.rollout.sync.timeout_s:g} s, + "
                              f"{peer - 2 * self.rollout.sync.timeout_s:g} s): the "
                              "learner ranks other than 0 wait that long in the sync's collectives while rank 0 "
                              "talks to the servers, inside one LearnerWorker.sync call; lower rollout.sync.timeout_s "
                              "or raise launch.rank_timeout_s")

    @property
    def sync_pause_mode(self) -> str:
        """/pause_generation's mode for the weight sync. ``abort`` (SGLang's default) where nothing is in flight at a
        sync (train.async off, one_step); ``retract`` where requests stay in flight across it (bounded): they are
        re-prefilled under the new weights and continue. Except with R3 (algo.routing_replay or routing_agreement):
        SGLang's retract recomputes every position's routes under the new weights (``Req.reset_for_retract``,
        serve/routed_experts.py), so the sync aborts the running requests and the rollout manager continues each
        as a new request, every segment with the routes its tokens were sampled under (rollout/manager.py)."""
        bounded = self.train.async_mode == "bounded"
        return "retract" if bounded and not self.algo.wants_routes else "abort"

    @property
    def gpu_run_keys(self) -> list[str]:
        """The config keys that make this a GPU run, whose learner ranks run on (and require) CUDA devices
        (empty: a CPU run): launch.gpus_per_node > 0, launch.gpus_per_learner_rank > 0, rollout.backend sglang."""
        la = self.launch
        keys = {f"launch.gpus_per_node={la.gpus_per_node}": la.gpus_per_node > 0,
                f"launch.gpus_per_learner_rank={la.gpus_per_learner_rank}": la.gpus_per_learner_rank > 0,
                "rollout.backend=sglang": self.rollout.backend == "sglang"}
        return [key for key, asks in keys.items() if asks]

    @property
    def learner_on_gpus(self) -> bool:
        """Whether the learner ranks run on GPUs (``gpu_run_keys``)."""
        return bool(self.gpu_run_keys)

    def _check_learner_memory_options(self) -> None:
        le = self.learner
        if le.optimizer_cpu_offload and not self.learner_on_gpus:
            raise ConfigError("learner.optimizer_cpu_offload: moves optimizer states from the GPU to the host "
                              "(Megatron's HybridDeviceOptimizer needs CUDA streams and pinned memory), but this is "
                              "a CPU run (launch.gpus_per_node=0, launch.gpus_per_learner_rank=0, rollout.backend "
                              "embedded), whose learner's states are on the host already; set it false")
        if le.refresh_kernel == "triton" and not self.learner_on_gpus:
            raise ConfigError("learner.refresh_kernel: triton runs on the learner's GPUs, but this is a CPU run "
                              "(launch.gpus_per_node=0, launch.gpus_per_learner_rank=0, rollout.backend embedded); "
                              "use auto or torch (Triton's interpreter, TRITON_INTERPRET=1, is the kernels' test mode: "
                              "tests/test_triton_refresh.py)")
        if le.recompute == "full" and self.algo.routing_replay:
            raise ConfigError("learner.recompute: 'full' reruns each layer's router in the backward, which would "
                              "route on its own instead of replaying the servers' routes (algo.routing_replay); "
                              "use 'selective' or 'none' with routing replay")

    def _check_sizes(self) -> None:
        """world_size against TP/EP, the batch against data parallelism, and GPU accounting."""
        tp, ep, ws = self.parallel.tp, self.parallel.ep, self.parallel.world_size
        unit = tp * ep // math.gcd(tp, ep)
        if ws is not None and ws % unit:
            raise ConfigError(f"parallel.world_size: {ws} is not a multiple of lcm(tp={tp}, ep={ep}) = {unit}")
        dp, batch = self.world_size // tp, self.train.prompts_per_step * self.rollout.sampling.n_samples
        if batch % dp:
            raise ConfigError(f"train.prompts_per_step: {self.train.prompts_per_step} prompts x "
                              f"{self.rollout.sampling.n_samples} samples = {batch} responses do not split over the "
                              f"learner's {dp} data-parallel ranks (world_size {self.world_size} / tp {tp})")
        self._check_gpus()

    def _check_gpus(self) -> None:
        """On GPU nodes (launch.gpus_per_node > 0) the learner and the servers use exactly the cluster's GPUs."""
        la, ro = self.launch, self.rollout
        if not la.gpus_per_node:
            return
        if la.gpus_per_learner_rank != 1:
            raise ConfigError(f"launch.gpus_per_learner_rank: must be 1 on GPU nodes (one Megatron rank per GPU), "
                              f"got {la.gpus_per_learner_rank}")
        if ro.gpus_per_server < 1 or la.gpus_per_node % ro.gpus_per_server:
            raise ConfigError(f"rollout.gpus_per_server: {ro.gpus_per_server} does not divide "
                              f"launch.gpus_per_node={la.gpus_per_node} (a server runs inside one node)")
        learner, servers = self.world_size, ro.servers * ro.gpus_per_server
        if learner + servers != la.nodes * la.gpus_per_node:
            raise ConfigError(f"launch.nodes: {la.nodes} nodes x {la.gpus_per_node} GPUs = "
                              f"{la.nodes * la.gpus_per_node}, but the learner uses {learner} (parallel.world_size)"
                              f" and the servers {servers} (rollout.servers={ro.servers} x gpus_per_server="
                              f"{ro.gpus_per_server}) = {learner + servers}")

    @model_validator(mode="after")
    def _check_layout(self) -> QarlConfig:
        from megatron_qarl.moe.model import Qwen3MoeArch

        arch = Qwen3MoeArch.from_model_dir(self.model.path)
        tp, ep = self.parallel.tp, self.parallel.ep
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
            if getattr(arch, name) % tp:
                raise ConfigError(f"parallel.tp: {tp} does not divide the model's {name} "
                                  f"({getattr(arch, name)}, {self.model.path}/config.json)")
        if arch.num_experts % ep:
            raise ConfigError(f"parallel.ep: {ep} does not divide the model's num_experts "
                              f"({arch.num_experts}, {self.model.path}/config.json)")
        if self.learner.recompute == "full" and arch.num_hidden_layers % self.learner.recompute_num_layers:
            raise ConfigError(f"learner.recompute_num_layers: {self.learner.recompute_num_layers} does not divide the "
                              f"model's {arch.num_hidden_layers} layers (full recompute runs chunks of that many)")
        self._check_sizes()
        return self


def _set_dotted(data: dict, key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {key}")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` strings; values are parsed as YAML scalars (``1e-5``, ``true``, ``[1,2]``)."""
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = _yaml(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: cannot parse value {raw!r}: {err}") from None
        _set_dotted(data, key.strip(), value)
    return data


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<config>"
        msg = e["msg"].removeprefix("Value error, ")
        head, sep, rest = msg.partition(": ")
        if sep and head.isidentifier() and e["type"] == "value_error":  # a model check naming its field
            key, msg = f"{key}.{head}" if key != "<config>" else head, rest
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            msg += f" (got {e['input']!r})" if not isinstance(e.get("input"), dict) else ""
        lines.append(f"{key}: {msg}")
    return "\n".join(lines)


def validate_config(data: dict, base_dir: str | Path | None = None, cls: type[BaseModel] = QarlConfig):
    """Validate a plain dict into ``cls``; raise ConfigError naming each bad key. ``base_dir``: the folder the
    relative paths of ``data`` are relative to (a config file's; ``resolve_paths``), else the current directory."""
    if base_dir is not None:
        data = resolve_paths(data, base_dir)
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


# the config keys that hold a path of the run's own files (module docstring, "Paths"); rollout.server_python is an
# interpreter on the servers' nodes: an absolute path or a command name, never relative (RolloutConfig)
PATH_KEYS = ("model.path", "data.source", "train.eval.data.source", "train.output_dir")


def resolve_paths(data: dict, base_dir: str | Path) -> dict:
    """``data`` (a copy of the sections it changes) with every relative path at ``PATH_KEYS`` made absolute against
    ``base_dir``, ``~`` expanded; a data source's ``synthetic`` is no path. ``preflight.rules.load_config`` calls it
    with the config file's folder on the file's values, then with the current directory on the command line's."""
    out = dict(data)
    for key in PATH_KEYS:
        parents, leaf = key.split(".")[:-1], key.split(".")[-1]
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                break
            node[part] = dict(node[part])
            node = node[part]
        else:
            value = node.get(leaf)
            if isinstance(value, str) and value and value != SYNTHETIC:
                node[leaf] = os.path.normpath(Path(base_dir).absolute() / Path(value).expanduser())
    return out


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = _yaml(p.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"{where}: invalid YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections")
    return data


def load_config_dict(path: str | Path, overrides: list[str] | None = None) -> dict:
    """A YAML config with its ``key.sub=value`` overrides, every path made absolute by the one rule (module
    docstring, "Paths"): the file's relative paths against its folder, the command line's against the current
    directory. ``preflight.rules.load_config`` validates it; the Slurm launcher reads its few keys from it."""
    data = resolve_paths(load_yaml(path), Path(path).absolute().parent)
    return resolve_paths(apply_overrides(data, list(overrides or [])), Path.cwd())
