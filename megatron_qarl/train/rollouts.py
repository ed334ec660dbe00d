"""The rollout servers as the trainer drives them: rollouts with failover, dead servers restarted, the
weight-update group (re)formed and the learner's weights synced.

Server faults are steps of the loop too: a server that fails mid-rollout is dropped and its requests go to the
others; when the last one fails, the rollout stops, the servers are restarted and get the current weights, and
the missing requests are sent again (``rollout``). Dead servers are restarted after each step, before the sync
(``heal``, then ``connect``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import UserError
from megatron_qarl.launch.fleet import LearnerRanks, ServerFleet
from megatron_qarl.rollout.client import ClientConfig, SGLangClient
from megatron_qarl.rollout.manager import EveryServerDown, RolloutManager, RoutesSpec, Sample, SamplingConfig
from megatron_qarl.rollout.vllm_client import VLLMClient

T = TypeVar("T")


class TrainingAborted(UserError):
    """The run cannot go on (too many non-finite steps in a row, every rollout server gone, ...)."""


class TrainRollouts:
    """Rollouts from ``servers`` and weight syncs from ``learners`` for one training run. ``on_sync`` receives
    every sync's report (the trainer records the weight version); ``console`` prints an operator message."""

    def __init__(self, cfg: QarlConfig, learners: LearnerRanks, servers: ServerFleet, stop_ids: list[int],
                 on_sync: Callable[[dict], None], console: Callable[[str], None] = print):
        self.cfg, self.learners, self.servers, self.stop_ids = cfg, learners, servers, stop_ids
        self.on_sync, self.console = on_sync, console
        self.weight_version: str | None = None  # what the servers hold: the last sync's version (None before one)

    def client(self, url: str) -> SGLangClient:
        r = self.cfg.rollout
        conf = ClientConfig(timeout_s=r.timeout_s, retries=r.retries, max_concurrency=r.max_concurrency)
        return (VLLMClient if r.backend == "vllm" else SGLangClient)(url, api_key=r.api_key, config=conf)

    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.servers.alive()) if a]

    def on_clients(self, live: list[int], work: Callable[[list[SGLangClient]], Awaitable[T]]) -> T:
        """``work`` with one client per ``live`` server, run to completion; the clients live as long as it."""

        async def run():
            clients = [self.client(self.servers.urls[i]) for i in live]
            try:
                return await work(clients)
            finally:
                for c in clients:
                    await c.close()

        return asyncio.run(run())

    def generate(self, manager: RolloutManager, prompts: list[list[int]], seed_step: int,
                 live: list[int]) -> list[list[Sample]]:
        """One round of ``manager``'s requests to the ``live`` servers.

        vLLM's answers carry no weight version; no sync runs while a round is in flight (the sequential loop
        syncs between rounds, one_step's sync waits for its background round, bounded is refused for vLLM), so
        the samples a round finishes were sampled by the version the servers held when it began, which is
        what they are stamped with (``stamp_versions``)."""
        version, before = self.weight_version, set(manager.finished)
        try:
            return self.on_clients(live, lambda clients: manager.generate(clients, prompts, seed_step))
        finally:  # the samples of a round that failed half-way too: the next round may run after a sync
            if self.cfg.rollout.backend == "vllm":
                stamp_versions([s for k, s in manager.finished.items() if k not in before],
                               version if self.weight_version == version else None)

    def rollout(self, prompts: list[list[int]], sampling: SamplingConfig, seed_step: int,
                routes: RoutesSpec | None = None, *, manager: RolloutManager | None = None,
                restart: bool = True) -> tuple[list[list[Sample]], RolloutManager]:
        """G samples per prompt from the live servers. A server that fails is dropped for this rollout and its
        requests go to the others; when every one has failed (rollout.restart_dead), the servers are restarted,
        get the current weights, and the requests that did not finish are sent again. ``manager``: continue
        that rollout (only its unfinished requests are sent); ``restart`` False (a rollout in a background
        thread, which must not sync): EveryServerDown is raised for the caller's thread to continue with."""
        manager = manager or RolloutManager(sampling, self.stop_ids, seed=self.cfg.seed, routes=routes)
        live = self.live()
        if not live:
            raise TrainingAborted("every rollout server is down")
        while True:
            try:
                return self.generate(manager, prompts, seed_step, live), manager
            except EveryServerDown:
                if not self.cfg.rollout.restart_dead or not restart:
                    raise
            for i in live:  # each one failed this round: dead, or running but not answering
                self.console(f"restarting rollout server {i} ({self.servers.urls[i]}) mid-rollout "
                             f"({len(manager.finished)} samples finished)")
                self.servers.restart(i)
            self.heal()  # any that were down before this rollout
            self.connect()
            self.sync()
            live = self.live()

    def rescore(self, groups: list[list[Sample]]) -> list[list[float]]:
        """The servers' log-probs of each sample's response tokens under the weights they hold now (one prefill
        per sample: /generate of prompt + response with ``logprob_start_len`` at the response and one greedy new
        token, whose ``input_token_logprobs`` are those log-probs), in sample order. SGLang computes input log-probs
        from the raw logits: these are log_softmax(z) whatever the sampling temperature (serve/sampling.py). The
        mismatch split of the asynchronous pipeline (train/pipeline.py) compares them with the learner's."""
        samples = [s for g in groups for s in g]
        live = self.live()
        if not live:
            raise TrainingAborted("every rollout server is down")

        async def one(client, s: Sample) -> list[float]:
            params = {"temperature": 0.0, "max_new_tokens": 1, "stop_token_ids": []}
            resp = await client.generate(s.prompt_ids + s.response_ids, params, return_logprob=True,
                                         logprob_start_len=len(s.prompt_ids))
            got = [float(t[0]) for t in resp["meta_info"]["input_token_logprobs"]][: len(s.response_ids)]
            if len(got) != len(s.response_ids):
                raise TrainingAborted(f"{client.url}: rescoring returned {len(got)} log-probs for "
                                      f"{len(s.response_ids)} response tokens")
            return got

        return self.on_clients(live, lambda clients: asyncio.gather(
            *(one(clients[k % len(clients)], s) for k, s in enumerate(samples))))

    def connect(self) -> None:
        """(Re)create the weight-update group with every live server."""
        self.learners.set_engines(list(self.servers.urls), max(1, self.cfg.rollout.gpus_per_server),
                                  self.cfg.rollout.api_key)

    def heal(self) -> bool:
        """Restart (or drop) dead servers; True when the weight group must be rebuilt."""
        alive = self.servers.alive()
        if all(alive):
            return False
        if not self.cfg.rollout.restart_dead:
            dead = [u for u, a in zip(self.servers.urls, alive, strict=True) if not a]
            raise TrainingAborted(f"rollout servers {dead} died and rollout.restart_dead is false")
        for i, ok in enumerate(alive):
            if not ok:
                self.console(f"restarting rollout server {i} ({self.servers.urls[i]})")
                self.servers.restart(i)
        return True

    def sync(self) -> dict:
        """Push the learner's weights to every server; the report goes to ``on_sync`` too."""
        self.weight_version = None  # a sync that fails leaves the servers' weights unknown
        report = self.learners.sync()
        self.weight_version = report["weight_version"]
        self.on_sync(report)
        return report


def stamp_versions(samples: Iterable[Sample], version: str | None) -> None:
    """Give the samples of one round whose answer named no weight version (vLLM's) ``version``, the one the servers
    held while they were sampled (None: not known, and the pipeline regenerates them). Samples with a version keep
    it."""
    for s in samples:
        if s.weight_version is None and s.token_versions is None:
            s.weight_version = version
