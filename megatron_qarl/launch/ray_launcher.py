"""Ray launch: learner ranks and rollout servers as Ray actors in one placement group.

On one machine the trainer starts a private Ray (``launch.ray_address`` None); on a cluster the Slurm
script starts a Ray head and workers and the trainer joins with ``ray_address: auto``. Bundles: one per
learner rank (``gpus_per_learner_rank`` GPUs, 1 CPU) and one per rollout server (``gpus_per_server``
GPUs, 1 CPU); STRICT_PACK on one node, PACK across nodes. Each server actor supervises its server
process (``qarl serve`` or SGLang) and restarts it on request; Ray supervises the actors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import UserError
from megatron_qarl.launch.fleet import LearnerRanks, check_server_interpreter, log_dir, server_command, server_env
from megatron_qarl.learner.worker import LearnerWorker
from megatron_qarl.rollout.process import ServerProcess

log = logging.getLogger(__name__)


class _ServerActor:
    """Runs on the server's node: picks a port there, starts and restarts the server process."""

    def __init__(self, cfg: QarlConfig, model_dir: str, index: int):
        import ray

        from megatron_qarl.moe.parallelize import free_port

        check_server_interpreter(cfg)  # on this node: rollout.server_python / launch_prefix, and the engine
        host = cfg.launch.server_host
        node_ip = ray.util.get_node_ip_address()
        url_host = "127.0.0.1" if host in ("127.0.0.1", "localhost") else node_ip
        port = free_port()
        env = server_env(cfg)
        gpus = ray.get_gpu_ids()
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        self.proc = ServerProcess(server_command(cfg, model_dir, host, port), f"http://{url_host}:{port}",
                                  log_dir(cfg) / f"server{index}.log", env=env,
                                  startup_timeout_s=cfg.rollout.startup_timeout_s, secret=cfg.rollout.api_key)

    def start(self) -> str:
        return self.proc.start()

    def alive(self) -> bool:
        return self.proc.alive()

    def restart(self) -> str:
        return self.proc.restart()

    def pid(self) -> int | None:
        return self.proc.pid()

    def stop(self) -> None:
        self.proc.stop()


def _init_ray(cfg: QarlConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    if cfg.launch.ray_address:
        ray.init(address=cfg.launch.ray_address, log_to_driver=False)
        return
    # a private single-machine Ray: logical CPUs are bookkeeping here (one per actor), threads are set apart
    need = cfg.world_size + cfg.rollout.servers
    ray.init(num_cpus=max(need, cfg.launch.num_cpus or os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False, configure_logging=False)


def placement_summary(pg, learner_ranks: int) -> str:
    """Which node (address) holds each learner rank and each server of the placement group."""
    import ray
    from ray.util import placement_group_table

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    where = [ips.get(nodes[i], "?") for i in range(len(nodes))]
    return (f"learner ranks on {', '.join(where[:learner_ranks])}; rollout servers on "
            f"{', '.join(where[learner_ranks:])}")


class RayCluster:
    """The placement group and both kinds of actors; ``learners`` and ``servers`` are what the trainer uses."""

    def __init__(self, cfg: QarlConfig, rollout_model_dir: str):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _init_ray(cfg)
        world, servers = cfg.world_size, cfg.rollout.servers
        gl, gs = cfg.launch.gpus_per_learner_rank, cfg.rollout.gpus_per_server
        bundles = [{"CPU": 1, **({"GPU": gl} if gl else {})} for _ in range(world)]
        bundles += [{"CPU": 1, **({"GPU": gs} if gs else {})} for _ in range(servers)]
        single_node = len(ray.nodes()) == 1
        self.pg = placement_group(bundles, strategy="STRICT_PACK" if single_node else "PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=cfg.rollout.startup_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise UserError(f"Ray could not place {world} learner ranks x {gl} GPU and {servers} servers x {gs} GPU "
                            f"(cluster resources: {ray.cluster_resources()}); check launch.* and rollout.*")

        def strategy(i):
            return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)

        threads = cfg.train.learner_threads or max(1, (os.cpu_count() or 1) // world)
        worker_cls = ray.remote(LearnerWorker)
        self.actors = [worker_cls.options(num_cpus=1, num_gpus=gl, scheduling_strategy=strategy(r),
                                          runtime_env={"env_vars": {"LOCAL_RANK": "0"}} if not gl else None)
                       .remote(cfg, r, world, threads) for r in range(world)]
        server_cls = ray.remote(_ServerActor)
        self.server_actors = [server_cls.options(num_cpus=1, num_gpus=gs, scheduling_strategy=strategy(world + i))
                              .remote(cfg, rollout_model_dir, i) for i in range(servers)]
        if not single_node:
            print(f"ray: {placement_summary(self.pg, world)}", flush=True)
        self.learners = RayLearnerRanks(self.actors)
        self.servers = _RayServers(self.server_actors)
        try:
            addr, port = ray.get(self.actors[0].address.remote())
            self.learners.on_every_rank(LearnerWorker.setup, addr, port)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        import ray

        for a in self.server_actors:
            try:
                ray.get(a.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - shutting down: an actor already gone is fine
                pass
        for a in self.actors + self.server_actors:
            ray.kill(a)
        ray.util.remove_placement_group(self.pg)


class RayLearnerRanks(LearnerRanks):
    """The learner ranks as Ray actors (one LearnerWorker each)."""

    def __init__(self, actors):
        self.actors = actors
        self.world = len(actors)

    def on_every_rank(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method.__name__).remote(*args) for a in self.actors])

    def close(self) -> None:
        """Close every rank's process groups; a rank that fails to (its actor already gone, say) is logged, and
        RayCluster.close kills the actors next either way."""
        try:
            super().close()
        except Exception as err:  # noqa: BLE001 - shutting down: say what failed, do not mask the run's own error
            log.warning("closing the learner ranks failed: %s: %s (their actors are killed next)",
                        type(err).__name__, err)


class _RayServers:
    def __init__(self, actors):
        import ray

        self.actors = actors
        self.urls = ray.get([a.start.remote() for a in actors])

    def alive(self) -> list[bool]:
        import ray

        return ray.get([a.alive.remote() for a in self.actors])

    def restart(self, i: int) -> str:
        import ray

        self.urls[i] = ray.get(self.actors[i].restart.remote())
        return self.urls[i]

    def pids(self) -> list[int | None]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        pass  # RayCluster.close stops them


