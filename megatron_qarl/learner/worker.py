"""One learner rank as the trainer drives it: the sharded policy and optimizer (Learner), the weight
broadcaster to the rollout servers, and checkpoints.

The launchers create one LearnerWorker per rank (in the driver process for a single rank, as a Ray
actor per rank otherwise) and call the same method on every rank in lockstep; methods are
collectives, and only rank 0's return value is meaningful.

A rank of a GPU run that finds no CUDA device refuses to start (``require_gpu``) instead of training on the CPU: Ray
hides every GPU from an actor placed without one, and a CUDA build of torch on such a process (or on a node whose
GPUs are gone) would otherwise run the Megatron CPU fixes and carry on.
"""

from __future__ import annotations

import os

import torch

from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import UserError
from megatron_qarl.wire import parse_dtype


def require_gpu(cfg: QarlConfig, rank: int) -> None:
    """UserError when the config asks for a GPU run and this process sees no CUDA device."""
    reasons = cfg.gpu_run_keys
    if not reasons or (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        return
    raise UserError(
        f"learner rank {rank}: the config asks for GPUs ({', '.join(reasons)}) but this process sees none "
        f"(torch {torch.__version__}, CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); it will not train on the CPU instead. Check the node's GPUs, "
        "launch.gpus_per_learner_rank (1: Ray gives each learner rank a GPU) and the allocation's --gpus-per-node; "
        "a CPU run sets launch.gpus_per_node=0, launch.gpus_per_learner_rank=0 and rollout.backend=embedded")


def require_bounded_nccl(rank: int, environ=os.environ) -> None:
    """UserError, before the rank joins any group, when its process would not fail an NCCL collective that outlives
    its timeout (``moe.parallelize.nccl_timeout_problem``: the environment this rank's actor got, legacy variable
    names included); gloo ranks honour their timeouts whatever the variables say."""
    from megatron_qarl.moe.parallelize import dist_backend, nccl_timeout_problem

    problem = nccl_timeout_problem(environ) if dist_backend() == "nccl" else None
    if problem:
        raise UserError(f"learner rank {rank}: {problem}, so launch.collective_timeout_s would not be honoured; unset "
                        "it in the job's environment (docs/cluster.md, 'Every wait is bounded')")


class LearnerWorker:
    def __init__(self, cfg: QarlConfig, rank: int, world: int, threads: int | None = None):
        self.cfg, self.rank, self.world, self.threads = cfg, rank, world, threads
        self.learner = None
        self.broadcaster = None
        self.weight_version = 0
        self.master_addr = "127.0.0.1"

    def address(self) -> tuple[str, int]:
        """(an address of this rank's host that the other ranks and the servers reach, a free port there)."""
        from megatron_qarl.moe.parallelize import free_port

        addr = self.cfg.launch.master_addr
        if addr == "auto":  # the address Ray knows this node by (the one other nodes reach), else the host's
            import socket

            try:
                import ray

                addr = ray.util.get_node_ip_address() if ray.is_initialized() else None
            except ImportError:
                addr = None
            addr = addr or socket.gethostbyname(socket.gethostname())
        return addr, free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the learner's process group, build the sharded model and load the checkpoint (a GPU run on a
        process without a GPU: UserError, before anything is built)."""
        from megatron_qarl.learner.rank import Learner
        from megatron_qarl.moe.model import Qwen3MoeArch
        from megatron_qarl.moe.parallelize import init_parallel
        from megatron_qarl.qat.kv_cache import run_spec

        cfg = self.cfg
        require_gpu(cfg, self.rank)
        require_bounded_nccl(self.rank)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK=str(int(os.environ.get("LOCAL_RANK", 0))))
        if self.threads:
            torch.set_num_threads(self.threads)
        self.master_addr = master_addr
        init_parallel(tp=cfg.parallel.tp, ep=cfg.parallel.ep, seed=cfg.seed, timeout_s=cfg.launch.collective_timeout_s)
        arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
        self.learner = Learner(arch, cfg.parallel, cfg.optim, dtype=parse_dtype(cfg.model.dtype), quant=cfg.quant,
                               aligned=cfg.learner.aligned, micro_batch_size=cfg.learner.micro_batch_size,
                               temperature=cfg.rollout.sampling.temperature,
                               routing_replay=cfg.algo.wants_routes, impl=cfg.model.impl, te_fp8=cfg.model.te_fp8,
                               attention=cfg.model.attention, compile_quantizer=cfg.learner.compile_quantizer,
                               refresh_kernel=cfg.learner.refresh_kernel,
                               distributed_optimizer=cfg.learner.distributed_optimizer,
                               optimizer_cpu_offload=cfg.learner.optimizer_cpu_offload,
                               optimizer_offload_fraction=cfg.learner.optimizer_offload_fraction,
                               recompute=cfg.learner.recompute, recompute_num_layers=cfg.learner.recompute_num_layers,
                               numerics=cfg.numerics, act_dtype=parse_dtype(cfg.rollout.dtype),
                               experts=cfg.model.experts, kv_cache=run_spec(cfg, arch.num_hidden_layers))
        self.learner.load_hf(cfg.model.path)

    # ------------------------------------------------------------------------------- compute
    def logprobs(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None = None,
                 temperature: float | None = None, lengths: list[int] | None = None,
                 kv_cache: bool = True) -> torch.Tensor | None:
        """The aligned forward log-probs [B, S-1] (the fake-quant weights when quantization is aligned);
        ``routes_BSLK`` replayed (R3), ``temperature`` instead of the sampling one, ``lengths`` the rows' needed
        lengths (packed sequences), ``kv_cache`` False without the servers' FP8 KV rounding
        (``Learner.forward_logprobs``)."""
        out = self.learner.forward_logprobs(tokens_BS, routes_BSLK, temperature, lengths, kv_cache)
        return out if self.rank == 0 else None

    def routing_logprobs(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None) -> dict | None:
        """R3: the aligned forward routing on its own (log-probs and the experts it chose) and, given the
        servers' routes, the aligned forward replaying them."""
        free_BT, own_BSLK = self.learner.forward_routes(tokens_BS)
        out = {"logp_free_BT": free_BT, "routes_BSLK": own_BSLK}
        if routes_BSLK is not None:
            out["logp_replay_BT"], out["replayed_BSLK"] = self.learner.forward_routes(tokens_BS, routes_BSLK)
        return out if self.rank == 0 else None

    def train(self, batch, loss_cfg, poison: bool = False) -> dict | None:
        """One optimizer step with algo/'s policy loss; ``poison`` multiplies the loss by NaN (fault drills)."""
        from megatron_qarl.learner.rank import policy_loss_fn

        loss_fn = policy_loss_fn(loss_cfg, batch)
        if poison:
            inner = loss_fn

            def loss_fn(logp_BT, b):
                loss, metrics = inner(logp_BT, b)
                return loss * float("nan"), metrics

        metrics = self.learner.train_step(batch, loss_fn)
        if self.rank != 0:
            return None
        return {k: float(v) for k, v in metrics.items()}

    # ------------------------------------------------------------------------------ weight sync
    def set_engines(self, urls: list[str], ranks_per_engine: int = 1, api_key: str | None = None) -> None:
        """(Re)create the broadcaster for these servers; an old weight-update group is closed first."""
        from megatron_qarl.sync.broadcaster import DistributedBroadcaster, Engine

        if self.broadcaster is not None:
            self.broadcaster.close()
        from megatron_qarl.sync.vllm_weight_update import VLLMWeightUpdateAPI
        from megatron_qarl.sync.weight_update import WeightUpdateAPI

        sync = self.cfg.rollout.sync
        self.broadcaster = DistributedBroadcaster(
            [Engine(u, ranks_per_engine, api_key) for u in urls], master_addr=self.master_addr,
            bucket_bytes=sync.bucket_mb << 20, dtype=parse_dtype(self.cfg.rollout.dtype), timeout_s=sync.timeout_s,
            verify=sync.verify, delta=sync.delta, pause_mode=self.cfg.sync_pause_mode,
            api_cls=VLLMWeightUpdateAPI if self.cfg.rollout.backend == "vllm" else WeightUpdateAPI)
        self.broadcaster.version = self.weight_version

    def sync(self) -> dict | None:
        report = self.broadcaster.sync(self.learner)
        self.weight_version = self.broadcaster.version
        if report is None:
            return None
        return {"weight_version": report.weight_version, "bytes": report.bytes, "tensors": report.tensors,
                "buckets": report.buckets, "seconds": report.seconds, "mode": report.mode, "check_s": report.check_s}

    # ------------------------------------------------------------------------------- checkpoints
    def _checkpoint_bound(self):
        """The learner groups' collectives wait launch.checkpoint_timeout_s while a checkpoint is written or read
        (the slowest rank's shards), launch.collective_timeout_s again after."""
        from megatron_qarl.moe.parallelize import collective_timeout

        la = self.cfg.launch
        return collective_timeout(la.checkpoint_timeout_s, la.collective_timeout_s)

    def save(self, path: str) -> None:
        from megatron_qarl.learner.checkpoint import save_learner

        with self._checkpoint_bound():
            save_learner(path, self.learner.module, self.learner.optimizer,
                         self.cfg.train.checkpoint.optimizer_format)

    def load(self, path: str, weight_version: int) -> None:
        from megatron_qarl.learner.checkpoint import load_learner
        from megatron_qarl.learner.rank import weights_changed

        with self._checkpoint_bound():
            load_learner(path, self.learner.module, self.learner.optimizer)
        weights_changed(self.learner)  # the fake-quant and exact caches of the loaded weights
        self.weight_version = weight_version
        if self.broadcaster is not None:
            self.broadcaster.version = weight_version

    def close(self) -> None:
        from megatron_qarl.moe.parallelize import destroy_parallel

        if self.broadcaster is not None:
            self.broadcaster.close()
            self.broadcaster = None
        destroy_parallel()
