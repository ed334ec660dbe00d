"""Ray launch: learner ranks and rollout servers as Ray actors in one placement group.

On one machine the trainer starts a private Ray (``launch.ray_address`` None); on a cluster the Slurm
script starts a Ray head and workers and the trainer joins with ``ray_address: auto``. Bundles: one per
learner rank (``gpus_per_learner_rank`` GPUs, 1 CPU) and one per rollout server (``gpus_per_server``
GPUs, 1 CPU); STRICT_PACK on one node, PACK across nodes. Each server actor supervises its server
process (``qarl serve`` or SGLang) and restarts it on request; Ray supervises the actors.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import UserError
from megatron_qarl.launch.fleet import (
    LearnerRanks,
    check_server_interpreter,
    learner_env,
    log_dir,
    server_command,
    server_env,
)
from megatron_qarl.learner.worker import LearnerWorker
from megatron_qarl.rollout.process import ServerProcess
from megatron_qarl.utils import stacks

log = logging.getLogger(__name__)


class _LearnerActor(LearnerWorker):
    """A learner rank as a Ray actor: a LearnerWorker whose every thread's stack goes into the run's log folder on
    SIGUSR2 (``<output_dir>/logs/learner_rank<r>.stacks``; the trainer sends it on and copies it, utils/stacks.py)."""

    def __init__(self, cfg: QarlConfig, rank: int, world: int, threads: int):
        self._stacks = stacks.dump_to_file(stacks_file(cfg, rank))
        super().__init__(cfg, rank, world, threads)

    def stacks_target(self) -> tuple[str, int]:
        """(Ray node id, pid) of this rank's process: where the trainer sends SIGUSR2."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


def stacks_file(cfg: QarlConfig, rank: int) -> Path:
    return log_dir(cfg) / f"learner_rank{rank}.stacks"


def _kill(pid: int, sig: int) -> None:
    os.kill(pid, sig)


def _send_stacks_signal(node_id: str, pid: int) -> None:
    """SIGUSR2 to ``pid`` on Ray node ``node_id``: directly on this node, else by a task pinned to that node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id == ray.get_runtime_context().get_node_id():
        os.kill(pid, stacks.STACKS_SIGNAL)
        return
    task = ray.remote(num_cpus=0)(_kill).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))
    ray_get(task.remote(pid, stacks.STACKS_SIGNAL), stacks.FORWARD_WAIT_S, f"os.kill({pid}) on Ray node {node_id}")


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


# how long a shutdown waits: every server's stop at once (``ServerProcess.stop``: SIGTERM, 10 s, SIGKILL, 10 s, and
# the actor's call around it), and the learner ranks' close (their groups; the broadcaster's, whose servers are told
# within sync/weight_update.py's CLEANUP_S); past it the actors are killed all the same
STOP_TIMEOUT_S = 60.0


def stop_servers(actors, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
    """``_ServerActor.stop`` on every server at once, all within one ``timeout_s``; the indices of those that did not
    stop in time or failed (logged: their actors are killed next either way)."""
    import ray

    refs = [a.stop.remote() for a in actors]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    failed = []
    for i, ref in enumerate(refs):
        try:
            if ref not in done:
                raise TimeoutError(f"no answer within {timeout_s:g} s")
            ray.get(ref, timeout=0)
        except Exception as err:  # noqa: BLE001 - shutting down: an actor already gone is fine
            log.debug("stopping rollout server %d: %s", i, err)
            failed.append(i)
    return failed


def ray_get(refs, timeout_s: float, what: str):
    """``ray.get(refs, timeout=timeout_s)``; past the bound a UserError naming ``what`` (the actor and method), the
    seconds and Ray's resources, total and free (a rank never placed shows as a demand no node can meet)."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise UserError(f"{what}: no answer within {timeout_s:g} s (ray cluster resources {ray.cluster_resources()}, "
                        f"available {ray.available_resources()}); see the actor's log, and the timeout's key in "
                        "docs/cluster.md ('Every wait is bounded')") from None


class RayCluster:
    """The placement group and both kinds of actors; ``learners`` and ``servers`` are what the trainer uses. On
    every exit path that leaves ``__init__`` by an exception (a server that does not start, a learner rank's
    setup that fails, KeyboardInterrupt) and on ``close`` the actors are killed and the placement group removed."""

    def __init__(self, cfg: QarlConfig, rollout_model_dir: str):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _init_ray(cfg)
        self.pg, self.actors, self.server_actors = None, [], []
        self._stop_stacks = lambda: None
        world, servers = cfg.world_size, cfg.rollout.servers
        gl, gs = cfg.launch.gpus_per_learner_rank, cfg.rollout.gpus_per_server
        bundles = [{"CPU": 1, **({"GPU": gl} if gl else {})} for _ in range(world)]
        bundles += [{"CPU": 1, **({"GPU": gs} if gs else {})} for _ in range(servers)]
        single_node = len(ray.nodes()) == 1
        try:
            self.pg = placement_group(bundles, strategy="STRICT_PACK" if single_node else "PACK")
            ready, _ = ray.wait([self.pg.ready()], timeout=cfg.rollout.startup_timeout_s)
            if not ready:
                raise UserError(f"Ray could not place {world} learner ranks x {gl} GPU and {servers} servers x {gs} "
                                f"GPU within rollout.startup_timeout_s={cfg.rollout.startup_timeout_s:g} s (cluster "
                                f"resources: {ray.cluster_resources()}, available: {ray.available_resources()}); "
                                "check launch.* and rollout.*")

            def strategy(i):
                return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)

            threads = cfg.train.learner_threads or max(1, (os.cpu_count() or 1) // world)
            worker_cls = ray.remote(_LearnerActor)
            env = learner_env(cfg)
            self.actors = [worker_cls.options(num_cpus=1, num_gpus=gl, scheduling_strategy=strategy(r),
                                              runtime_env={"env_vars": env} if env else None)
                           .remote(cfg, r, world, threads) for r in range(world)]
            server_cls = ray.remote(_ServerActor)
            self.server_actors = [server_cls.options(num_cpus=1, num_gpus=gs, scheduling_strategy=strategy(world + i))
                                  .remote(cfg, rollout_model_dir, i) for i in range(servers)]
            if not single_node:
                print(f"ray: {placement_summary(self.pg, world)}", flush=True)
            self.learners = RayLearnerRanks(self.actors, cfg.launch.rank_timeout_s)
            self.servers = _RayServers(self.server_actors, cfg)
            addr, port = ray_get(self.actors[0].address.remote(), cfg.launch.rank_timeout_s,
                                 "learner rank 0's LearnerWorker.address (launch.rank_timeout_s)")
            self.learners.on_every_rank(LearnerWorker.setup, addr, port)
            self._stop_stacks = self._forward_stacks(cfg)
        except BaseException:
            self.close()
            raise

    def _forward_stacks(self, cfg: QarlConfig):
        """SIGUSR2 to the trainer reaches every learner rank too (utils/stacks.py); returns what stops it."""
        where = self.learners.on_every_rank(_LearnerActor.stacks_target)
        targets = [stacks.Target(f"learner rank {r} (pid {pid})", functools.partial(_send_stacks_signal, node, pid),
                                 stacks_file(cfg, r)) for r, (node, pid) in enumerate(where)]
        return stacks.forward(targets)

    def close(self) -> None:
        """Stop the servers, kill every actor, remove the placement group; safe to call twice and after a partial
        ``__init__``, and each step runs whatever the one before it raised."""
        import ray

        self._stop_stacks()
        try:
            stop_servers(self.server_actors)  # all at once, within STOP_TIMEOUT_S
        finally:
            try:
                for a in self.actors + self.server_actors:
                    try:
                        ray.kill(a)
                    except Exception as err:  # noqa: BLE001 - already dead
                        log.debug("killing %s: %s", a, err)
            finally:
                self.actors, self.server_actors = [], []
                if self.pg is not None:
                    ray.util.remove_placement_group(self.pg)
                    self.pg = None


class RayLearnerRanks(LearnerRanks):
    """The learner ranks as Ray actors (one LearnerWorker each); every call waits ``timeout_s`` at most
    (launch.rank_timeout_s). A call that did not answer in time leaves the ranks ``stuck``: an actor runs one call at
    a time, so anything queued behind the stuck one would only wait its turn."""

    def __init__(self, actors, timeout_s: float):
        self.actors = actors
        self.world = len(actors)
        self.timeout_s = timeout_s
        self.stuck: str | None = None  # the call that did not answer within timeout_s

    def on_every_rank(self, method: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``timeout_s``: instead of launch.rank_timeout_s (the shutdown's STOP_TIMEOUT_S)."""
        bound = "launch.rank_timeout_s" if timeout_s is None else f"shutdown, {timeout_s:g} s"
        what = f"LearnerWorker.{method.__name__} on {self.world} learner rank(s) ({bound})"
        try:
            return ray_get([getattr(a, method.__name__).remote(*args) for a in self.actors],
                           self.timeout_s if timeout_s is None else timeout_s, what)
        except UserError:
            self.stuck = what
            raise

    def close(self) -> None:
        """Close every rank's process groups within STOP_TIMEOUT_S; after a call that did not answer (``stuck``)
        nothing is queued behind it: RayCluster.close kills the actors next, which ends their groups with them. A
        rank that fails to close (its actor already gone, say) is logged; the actors are killed either way."""
        if self.stuck is not None:
            log.warning("not closing the learner ranks' groups: %s did not answer; their actors are killed",
                        self.stuck)
            return
        try:
            self.on_every_rank(LearnerWorker.close, timeout_s=STOP_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - shutting down: say what failed, do not mask the run's own error
            log.warning("closing the learner ranks failed: %s: %s (their actors are killed next)",
                        type(err).__name__, err)


class _RayServers:
    """The server actors as the trainer's ServerFleet. A start or restart waits for the server's own start-up bound
    (rollout.startup_timeout_s) plus the actor's creation (launch.rank_timeout_s covers a slow node); a question
    (alive, pids) rollout.timeout_s."""

    def __init__(self, actors, cfg: QarlConfig):
        self.actors = actors
        self.start_timeout_s = cfg.rollout.startup_timeout_s + 60.0  # + the actor's own start (imports, a port)
        self.ask_timeout_s = cfg.rollout.timeout_s
        self.urls = ray_get([a.start.remote() for a in actors], self.start_timeout_s,
                            f"{len(actors)} rollout server(s)' _ServerActor.start (rollout.startup_timeout_s + 60 s)")

    def alive(self) -> list[bool]:
        return ray_get([a.alive.remote() for a in self.actors], self.ask_timeout_s,
                       "the rollout servers' _ServerActor.alive (rollout.timeout_s)")

    def restart(self, i: int) -> str:
        self.urls[i] = ray_get(self.actors[i].restart.remote(), self.start_timeout_s,
                               f"rollout server {i}'s _ServerActor.restart (rollout.startup_timeout_s + 60 s)")
        return self.urls[i]

    def pids(self) -> list[int | None]:
        return ray_get([a.pid.remote() for a in self.actors], self.ask_timeout_s,
                       "the rollout servers' _ServerActor.pid (rollout.timeout_s)")

    def close(self) -> None:
        pass  # RayCluster.close stops them
