"""A Ray cluster leaves nothing behind (issue 46): on every exit path of ``RayCluster`` and of ``qarl train``'s run
(a server that fails to start, a learner rank whose setup fails, KeyboardInterrupt while it starts, the trainer's
``close`` raising, KeyboardInterrupt mid-run) the placement group is removed and the actors are killed: Ray's own
state (``placement_group_table``) holds no live group, and a new cluster of the same size is placed at once.

The module's Ray has exactly the cluster's CPUs (2: one learner rank, one server), so a group left behind would
leave no CPU for the next one (what hung the vLLM combination test on an AMX machine)."""

from __future__ import annotations

import time

import pytest

from megatron_qarl.preflight.rules import load_config

pytestmark = [pytest.mark.e2e]

BUNDLES = [{"CPU": 1}, {"CPU": 1}]  # one learner rank and one server: RayCluster's bundles for these configs
SMALL = ["launch.backend=ray", "train.steps=1", "train.prompts_per_step=1", "rollout.sampling.n_samples=2",
         "rollout.sampling.max_new_tokens=4", "train.eval.every=0", "train.eval.n=1", "train.eval.sampled_n=0",
         "train.checkpoint.every=0", "reward.kind=exact", "train.learner_threads=1", "rollout.threads=1",
         "rollout.startup_timeout_s=300", "rollout.api_key=qarl-ray-key"]


@pytest.fixture(scope="module")
def ray_two_cpus():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _cfg(tmp_path, *overrides):
    return load_config("configs/cpu_bf16_rollout.yaml", [*SMALL, f"train.output_dir={tmp_path / 'run'}", *overrides])


def assert_nothing_left(ray) -> None:
    """No live placement group (Ray's state API), every CPU free again, and a cluster of the same size placed at
    once."""
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group

    deadline = time.monotonic() + 20
    while True:
        live = {k: v["state"] for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
        free = ray.available_resources().get("CPU", 0)
        if (not live and free == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not live, f"placement groups left behind: {live}"
    assert free == 2, ray.available_resources()
    pg = placement_group(BUNDLES, strategy="STRICT_PACK")
    try:
        ready, _ = ray.wait([pg.ready()], timeout=30)
        assert ready, f"a new cluster of the same size was not placed: {ray.available_resources()}"
    finally:
        remove_placement_group(pg)


def test_a_server_that_fails_to_start_leaves_no_placement_group(ray_two_cpus, tmp_path, tiny_model_dir):
    """Fails on aa05666: the server actors' start ran outside the try that closes the cluster."""
    from megatron_qarl.launch.ray_launcher import RayCluster

    cfg = _cfg(tmp_path, "rollout.server_python=/bin/false")  # the server actor refuses the interpreter
    with pytest.raises(Exception, match="/bin/false"):
        RayCluster(cfg, tiny_model_dir)
    assert_nothing_left(ray_two_cpus)


def test_a_learner_setup_that_fails_leaves_no_placement_group(ray_two_cpus, tmp_path, tiny_model_dir):
    """The learner's checkpoint is unreadable (its weights file truncated); the servers serve a good copy."""
    from megatron_qarl.launch.ray_launcher import RayCluster

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in __import__("pathlib").Path(tiny_model_dir).iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes()[:1000] if f.name == "model.safetensors" else f.read_bytes())
    cfg = _cfg(tmp_path, f"model.path={broken}")
    with pytest.raises(Exception, match="LearnerWorker.setup|safetensors|header|deserializ"):
        RayCluster(cfg, tiny_model_dir)
    assert_nothing_left(ray_two_cpus)


def test_a_keyboard_interrupt_while_the_cluster_starts_leaves_no_placement_group(ray_two_cpus, tmp_path,
                                                                                 tiny_model_dir, monkeypatch):
    from megatron_qarl.launch import ray_launcher

    def interrupted(self, method, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_launcher.RayLearnerRanks, "on_every_rank", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ray_launcher.RayCluster(_cfg(tmp_path), tiny_model_dir)
    assert_nothing_left(ray_two_cpus)


class _Trainer:
    """Stands in for the Trainer in ``qarl train``'s run (the cluster around it is the real one): ``run`` and
    ``close`` do what the test says."""

    on_run: BaseException | None = None
    on_close: BaseException | None = None

    def __init__(self, *args, **kwargs):
        pass

    def run(self, stop=None):
        if self.on_run is not None:
            raise self.on_run
        return {}

    def close(self):
        if self.on_close is not None:
            raise self.on_close


@pytest.mark.parametrize("on_run, on_close, raised", [
    (None, RuntimeError("the trainer's close failed"), RuntimeError),
    (KeyboardInterrupt(), None, KeyboardInterrupt),
], ids=["trainer_close_raises", "keyboard_interrupt_mid_run"])
def test_qarl_trains_exit_paths_leave_no_placement_group(ray_two_cpus, tmp_path, monkeypatch, on_run, on_close,
                                                        raised):
    """Fails on aa05666 for a raising close: the closers after ``trainer.close()`` never ran."""
    from megatron_qarl.train import cli, trainer

    monkeypatch.setattr(trainer, "Trainer", type("T", (_Trainer,), {"on_run": on_run, "on_close": on_close}))
    with pytest.raises(raised):
        cli.run(_cfg(tmp_path), progress=False, preflight=False)
    assert_nothing_left(ray_two_cpus)


def test_a_close_after_a_stuck_rank_takes_one_bound_not_one_per_wait(ray_two_cpus, tmp_path):
    """Issue 53 item 4: after a learner rank's call timed out, ``RayLearnerRanks.close`` queued ``close`` behind the
    stuck call on the same actor and waited another launch.rank_timeout_s (here 5 s), and ``RayCluster.close`` then
    stopped the servers one after another (3 x 3 s here; up to rollout.timeout_s each). Now nothing is queued behind
    a stuck call (the actors are killed) and the servers stop at once: the whole close takes one server's stop."""
    from megatron_qarl.errors import UserError
    from megatron_qarl.launch.ray_launcher import RayCluster, RayLearnerRanks
    from megatron_qarl.learner.worker import LearnerWorker
    from megatron_qarl.moe.parallelize import free_port

    class SlowToStop:  # defined here: Ray pickles it by value (the workers cannot import tests/)
        """A rollout server's actor whose stop takes ``seconds`` (a server using its SIGTERM grace)."""

        def __init__(self, seconds: float):
            self.seconds = seconds

        def stop(self) -> None:
            time.sleep(self.seconds)

    ray = ray_two_cpus
    cfg = _cfg(tmp_path)
    rank = ray.remote(LearnerWorker).options(num_cpus=0, runtime_env={"env_vars": {"LOCAL_RANK": "0"}}).remote(
        cfg, 0, 2)  # rank 0 of a world of two whose rank 1 never comes: its setup waits in the rendezvous
    ray.get(rank.address.remote(), timeout=120)  # the actor is up: the next call runs, it is not queued
    learners = RayLearnerRanks([rank], timeout_s=5.0)
    with pytest.raises(UserError, match=r"LearnerWorker\.setup on 1 learner rank\(s\) .*no answer within 5 s"):
        learners.on_every_rank(LearnerWorker.setup, "127.0.0.1", free_port())
    servers = [ray.remote(SlowToStop).options(num_cpus=0).remote(3.0) for _ in range(3)]
    ray.get([s.__ray_ready__.remote() for s in servers], timeout=60)
    cluster = RayCluster.__new__(RayCluster)  # the cluster around them, as __init__ leaves it
    cluster.pg, cluster.actors, cluster.server_actors = None, [rank], servers
    cluster._stop_timeout_s = cfg.rollout.timeout_s  # what main before issue 53 read
    cluster._stop_stacks = lambda: None  # the stack-dump forwarding __init__ sets up (utils/stacks.py)
    t0 = time.monotonic()
    learners.close()
    cluster.close()
    took = time.monotonic() - t0
    print(f"\nclose after a stuck rank, 3 servers each 3 s to stop: {took:.1f} s")
    assert took < 8.0, took  # before: >= 5 (the queued close) + 9 (three stops in turn)
    assert cluster.actors == [] and cluster.server_actors == []
