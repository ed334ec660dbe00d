"""Local launch: one learner rank in this process, rollout servers as child processes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from megatron_qarl.config import QarlConfig
from megatron_qarl.launch.fleet import LearnerRanks, check_server_interpreter, log_dir, server_command, server_env
from megatron_qarl.learner.worker import LearnerWorker
from megatron_qarl.moe.parallelize import free_port
from megatron_qarl.rollout.process import ServerProcess


class LocalLearnerRanks(LearnerRanks):
    """The one learner rank, a LearnerWorker in this process."""

    def __init__(self, cfg: QarlConfig):
        if cfg.world_size != 1:
            raise ValueError(f"local launch runs one learner rank, the config needs {cfg.world_size}")
        self.world = 1
        self.worker = LearnerWorker(cfg, 0, 1, cfg.train.learner_threads or os.cpu_count())
        self.worker.setup(*self.worker.address())

    def on_every_rank(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        return [method(self.worker, *args)]


class LocalServers:
    """``rollout.servers`` server processes on this machine. ``wait=False``: return once they are spawned (the
    caller builds its learner while they load, then calls ``wait_ready``)."""

    def __init__(self, cfg: QarlConfig, model_dir: str, *, wait: bool = True):
        host = cfg.launch.server_host
        check_server_interpreter(cfg)  # rollout.server_python / launch_prefix exist here and have the engine
        self.procs = []
        for i in range(cfg.rollout.servers):
            port = free_port()
            url_host = "127.0.0.1" if host in ("0.0.0.0", "127.0.0.1", "localhost") else host
            self.procs.append(ServerProcess(server_command(cfg, model_dir, host, port), f"http://{url_host}:{port}",
                                            log_dir(cfg) / f"server{i}.log", env=server_env(cfg),
                                            startup_timeout_s=cfg.rollout.startup_timeout_s,
                                            secret=cfg.rollout.api_key))
        self.urls = [p.url for p in self.procs]
        try:
            for p in self.procs:
                p.spawn()
        except BaseException:
            self.close()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> list[str]:
        """Wait until every server answers /health (each within rollout.startup_timeout_s of its spawn); on a
        failure every server is stopped and the error names the one that failed."""
        try:
            for p in self.procs:
                p.wait_ready()
        except BaseException:
            self.close()
            raise
        return self.urls

    def alive(self) -> list[bool]:
        return [p.alive() for p in self.procs]

    def restart(self, i: int) -> str:
        self.urls[i] = self.procs[i].restart()
        return self.urls[i]

    def pids(self) -> list[int | None]:
        return [p.pid() for p in self.procs]

    def close(self) -> None:
        """Stop every server at once (each ``ServerProcess.stop`` is bounded: SIGTERM, 10 s, SIGKILL, 10 s)."""
        from concurrent.futures import ThreadPoolExecutor

        if self.procs:
            with ThreadPoolExecutor(len(self.procs)) as pool:
                list(pool.map(ServerProcess.stop, self.procs))
