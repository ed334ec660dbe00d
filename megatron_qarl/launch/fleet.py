"""What the trainer sees of a launch: the learner ranks (``LearnerRanks``: one LearnerWorker per rank, called in
lockstep) and a server fleet (rollout server URLs that can be checked and restarted). launch/local.py and
launch/ray_launcher.py implement both."""

from __future__ import annotations

import abc
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from megatron_qarl.config import QarlConfig
from megatron_qarl.learner_worker import LearnerWorker
from megatron_qarl.rollout.process import embedded_command
from megatron_qarl.rollout.sglang_launcher import SGLangServerSpec, launch_command

if TYPE_CHECKING:
    import torch

    from megatron_qarl.algo.policy_loss import PolicyLossConfig
    from megatron_qarl.learner import Batch

T = TypeVar("T")


class LearnerRanks(abc.ABC):
    """The trainer's handle to the learner ranks, the same over Ray and in one process. Each method runs the
    LearnerWorker method of the same name on every rank at once (they are collectives) and returns rank 0's
    result, the one that is meaningful. A launcher says only how to reach every rank (``on_every_rank``)."""

    world: int

    @abc.abstractmethod
    def on_every_rank(self, method: Callable[..., T], *args: Any) -> list[T]:
        """``method`` (a LearnerWorker method) called on every rank at once; per-rank results in rank order."""

    def load(self, path: str, weight_version: int) -> None:
        self.on_every_rank(LearnerWorker.load, path, weight_version)

    def set_engines(self, urls: list[str], ranks_per_engine: int, api_key: str | None) -> None:
        self.on_every_rank(LearnerWorker.set_engines, urls, ranks_per_engine, api_key)

    def sync(self) -> dict:
        return self.on_every_rank(LearnerWorker.sync)[0]

    def logprobs(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.on_every_rank(LearnerWorker.logprobs, tokens_BS)[0]

    def routing_logprobs(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None) -> dict:
        return self.on_every_rank(LearnerWorker.routing_logprobs, tokens_BS, routes_BSLK)[0]

    def train(self, batch: Batch, loss_cfg: PolicyLossConfig, poison: bool = False) -> dict:
        return self.on_every_rank(LearnerWorker.train, batch, loss_cfg, poison)[0]

    def save(self, path: str) -> None:
        self.on_every_rank(LearnerWorker.save, path)

    def close(self) -> None:
        self.on_every_rank(LearnerWorker.close)


class ServerFleet(Protocol):
    urls: list[str]

    def alive(self) -> list[bool]: ...

    def restart(self, i: int) -> str: ...

    def pids(self) -> list[int | None]: ...

    def close(self) -> None: ...


def server_command(cfg: QarlConfig, model_dir: str, host: str, port: int) -> list[str]:
    """The command of one rollout server for this config (embedded ``qarl serve`` or SGLang)."""
    r = cfg.rollout
    if r.backend == "embedded":
        return embedded_command(model_dir, port, host=host, dtype=r.dtype, max_batch_size=r.max_batch_size,
                                return_routed_experts=cfg.algo.wants_routes, api_key=r.api_key)
    # the rollout manager seeds every sample (rollout/manager.py), which SGLang honours only in
    # deterministic inference
    spec = SGLangServerSpec(model_path=model_dir, host=host, port=port, tp=r.gpus_per_server, ep=r.ep_size,
                            dp=r.dp_size, mem_fraction_static=r.mem_fraction_static, api_key=r.api_key,
                            random_seed=cfg.seed, deterministic_inference=True,
                            return_routed_experts=cfg.algo.wants_routes,
                            extra_args=("--max-running-requests", str(r.max_batch_size)))
    return launch_command(spec)


def server_env(cfg: QarlConfig) -> dict[str, str]:
    threads = cfg.rollout.threads
    return {"OMP_NUM_THREADS": str(threads)} if threads else {}


def log_dir(cfg: QarlConfig) -> Path:
    return Path(cfg.train.output_dir) / "logs"
