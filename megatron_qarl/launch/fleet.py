"""What the trainer sees of a launch: a learner group (one LearnerWorker per rank, called in lockstep)
and a server fleet (rollout server URLs that can be checked and restarted). launch/local.py and
launch/ray_launcher.py implement both."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from megatron_qarl.config import QarlConfig
from megatron_qarl.rollout.process import embedded_command
from megatron_qarl.rollout.sglang_launcher import SGLangServerSpec, launch_command


class LearnerGroup(Protocol):
    world: int

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank at once; per-rank results in rank order."""

    def close(self) -> None: ...


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
                                api_key=r.api_key)
    spec = SGLangServerSpec(model_path=model_dir, host=host, port=port, tp=r.gpus_per_server,
                            mem_fraction_static=r.mem_fraction_static, api_key=r.api_key, random_seed=cfg.seed,
                            extra_args=("--max-running-requests", str(r.max_batch_size)))
    return launch_command(spec)


def server_env(cfg: QarlConfig) -> dict[str, str]:
    threads = cfg.rollout.threads
    return {"OMP_NUM_THREADS": str(threads)} if threads else {}


def log_dir(cfg: QarlConfig) -> Path:
    return Path(cfg.train.output_dir) / "logs"
