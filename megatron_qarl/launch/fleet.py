"""What the trainer sees of a launch: the learner ranks (``LearnerRanks``: one LearnerWorker per rank, called in
lockstep) and a server fleet (rollout server URLs that can be checked and restarted). launch/local.py and
launch/ray_launcher.py implement both. Every server starts as ``server_command`` says, through the interpreter the
config names (``rollout.server_python`` and ``rollout.launch_prefix``), checked on its node before it starts."""

from __future__ import annotations

import abc
import importlib.util
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import ConfigError
from megatron_qarl.learner.worker import LearnerWorker
from megatron_qarl.rollout.process import embedded_command
from megatron_qarl.rollout.sglang_launcher import SGLangServerSpec, launch_command
from megatron_qarl.rollout.vllm_launcher import MODULE as VLLM_MODULE
from megatron_qarl.rollout.vllm_launcher import VLLMServerSpec, vllm_command, vllm_env
from megatron_qarl.utils.api_key import ENV as API_KEY_ENV
from megatron_qarl.utils.api_key import sglang_key_file

if TYPE_CHECKING:
    import torch

    from megatron_qarl.algo.policy_loss import PolicyLossConfig
    from megatron_qarl.learner.rank import Batch

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

    def logprobs(self, tokens_BS: torch.Tensor, routes_BSLK: torch.Tensor | None = None,
                 temperature: float | None = None, lengths: list[int] | None = None,
                 kv_cache: bool = True) -> torch.Tensor:
        return self.on_every_rank(LearnerWorker.logprobs, tokens_BS, routes_BSLK, temperature, lengths, kv_cache)[0]

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


# the package each backend's server runs (``python -m``), whose top-level package the server's interpreter must
# import; a new backend (vLLM, issue 22) adds its own here and reuses rollout.server_python / launch_prefix
SERVER_MODULES = {"embedded": "megatron_qarl.cli", "sglang": "sglang.launch_server", "vllm": VLLM_MODULE}


def server_interpreter(cfg: QarlConfig) -> list[str]:
    """The argv that every rollout server's command starts with: ``[*rollout.launch_prefix, python]``, python
    being ``rollout.server_python`` or, unset, the trainer's own interpreter."""
    r = cfg.rollout
    return [*r.launch_prefix, r.server_python or sys.executable]


def check_server_interpreter(cfg: QarlConfig) -> None:
    """Before a server starts, on the node that starts it: the configured interpreter (or, with a launch prefix,
    the prefix's program) is an executable file here, and the interpreter can import the backend's package. A
    ConfigError names the key at fault. (Not checked at config load: the config is loaded also where the servers'
    environment does not exist, such as the head node, ``qarl plan`` and CI.)"""
    r = cfg.rollout
    argv = server_interpreter(cfg)
    key = "rollout.launch_prefix" if r.launch_prefix else "rollout.server_python"
    where = socket.gethostname()
    if shutil.which(argv[0]) is None:
        what = "not an executable file" if "/" in argv[0] else "not found on PATH"
        hint = ("" if r.launch_prefix else " (the servers' own environment, docs/cluster.md \"Installing\"; unset, "
                "the trainer's interpreter)")
        raise ConfigError(f"{key}: {argv[0]!r} is {what} on {where}{hint}")
    package = SERVER_MODULES[r.backend].split(".")[0]
    if argv == [sys.executable]:  # this very interpreter: no need to start another one to ask
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"rollout.server_python: unset, so {r.backend} servers run on the trainer's "
                              f"interpreter {sys.executable}, which cannot import {package}; set it to the python of "
                              f"the servers' environment (docs/cluster.md, \"Installing\")")
        return
    probe = [*argv, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"]
    try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"{key}: {shlex.join(probe)} failed on {where}: {err}") from None
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"rollout.server_python: {shlex.join(argv)} cannot import {package} on {where} (exit "
                          f"{proc.returncode}{': ' + ' | '.join(out) if out else ''}); rollout.backend="
                          f"{r.backend} needs it installed there (docs/cluster.md, \"Installing\")")


def server_command(cfg: QarlConfig, model_dir: str, host: str, port: int) -> list[str]:
    """The command of one rollout server for this config (embedded ``qarl serve``, SGLang or vLLM), started by
    ``server_interpreter``: the configured launch prefix and interpreter."""
    r = cfg.rollout
    *prefix, python = server_interpreter(cfg)
    if r.backend == "vllm":
        spec = VLLMServerSpec(model_path=model_dir, host=host, port=port, tp=r.gpus_per_server, dtype=r.dtype,
                              max_num_seqs=r.max_batch_size, seed=cfg.seed, api_key=r.api_key)
        return [*prefix, *vllm_command(spec, python=python)]
    if r.backend == "embedded":
        return [*prefix, *embedded_command(model_dir, port, host=host, dtype=r.dtype, max_batch_size=r.max_batch_size,
                                           return_routed_experts=cfg.algo.wants_routes, python=python,
                                           numerics=cfg.numerics, kv_cache_dtype=r.kv_cache_dtype)]
    # the rollout manager seeds every sample (rollout/manager.py), which SGLang honours only in
    # deterministic inference
    spec = SGLangServerSpec(model_path=model_dir, host=host, port=port, tp=r.gpus_per_server, ep=r.ep_size,
                            dp=r.dp_size, mem_fraction_static=r.mem_fraction_static,
                            api_key_file=r.api_key and str(sglang_key_file(
                                r.api_key, log_dir(cfg), f"sglang-{socket.gethostname()}-{port}.key.yaml")),
                            random_seed=cfg.seed, deterministic_inference=True,
                            return_routed_experts=cfg.algo.wants_routes, kv_cache_dtype=r.kv_cache_dtype,
                            extra_args=("--max-running-requests", str(r.max_batch_size)))
    return [*prefix, *launch_command(spec, python=python)]


def server_env(cfg: QarlConfig) -> dict[str, str]:
    """What every server's environment gets on top of its launcher's: the embedded server's torch threads and API
    key ($QARL_API_KEY, utils/api_key.py); vLLM's weight-transfer routes, our worker extension and middleware, the
    API key and its CPU KV cache (rollout/vllm_launcher.py). SGLang's key is in a file (``server_command``)."""
    threads = cfg.rollout.threads
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    if cfg.rollout.backend == "embedded":  # set even when empty: never a key the launcher's environment carries
        env[API_KEY_ENV] = cfg.rollout.api_key or ""
    return {**env, **vllm_env(cfg.rollout.api_key)} if cfg.rollout.backend == "vllm" else env


def learner_env(cfg: QarlConfig) -> dict[str, str]:
    """What every learner rank's Ray actor gets on top of its node's environment (the raylet's: the job's on a
    Slurm cluster, the driver's for a local Ray): LOCAL_RANK 0 where Ray gives the rank no GPU (Megatron reads it).
    ``qarl preflight`` reads the NCCL variables of the environment the ranks get from this too."""
    return {} if cfg.launch.gpus_per_learner_rank else {"LOCAL_RANK": "0"}


def log_dir(cfg: QarlConfig) -> Path:
    return Path(cfg.train.output_dir) / "logs"
