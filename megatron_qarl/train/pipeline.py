"""Asynchronous rollouts: where each training step's samples come from (``train.async``).

    off       the step's rollout runs in line, after the previous step's weight sync (on-policy: every token
              was sampled by the weights the learner holds, staleness 0).
    one_step  step t+1's rollout is sampled (in a background thread) while step t computes rewards, aligned
              log-probs and its update; the sync after step t waits for it, so no request spans a sync and every
              token of step t+1 is exactly one weight version behind the learner that trains on it (verl's
              one-step-off-policy, NeMo-RL's async GRPO with max age 1).
    bounded   rollouts of up to ``train.max_staleness`` steps ahead are in flight while the learner trains;
              the sync does not wait: it pauses the servers with SGLang's ``pause_generation`` mode
              ``retract`` (sync/broadcaster.py), the running requests lose their KV cache, and on
              ``continue_generation`` they are re-prefilled and continue under the new weights. A request
              that spans a sync returns each token range's weight version (SGLang's ``meta_info
              ["weight_versions"]``), so staleness is known per token (AReaL's bounded staleness with partial
              rollouts).

Why ``retract`` and not ``in_place`` or ``abort``: ``abort`` ends the requests (their partial output would be
trained on as truncated, or thrown away); ``in_place`` keeps the KV cache computed by the old weights, so the
tokens sampled after the sync come from neither version's distribution and no per-token behaviour log-prob is
exact; ``retract`` recomputes the cache under the new weights, so every token is sampled by exactly one version
and the log-prob the server returns with it is that version's (SGLang documents that retract rebuilds the KV
"under the new weights", sglang/srt/managers/scheduler.py, pause_generation). The price is one re-prefill of
each running request per sync.

With R3 (routes wanted) the sync aborts instead (``QarlConfig.sync_pause_mode``): SGLang's retract also recomputes
the routes of every position already forwarded, under the new weights (``Req.reset_for_retract``), so the routes
of tokens the old version sampled would be lost. An aborted request keeps its partial output and routes, and the
rollout manager continues it as a new request from prompt + that output (rollout/manager.py, ``max_idle_aborts``),
so every segment's routes are those its tokens were sampled under; the price is the same re-prefill.

Bound: a sample any of whose tokens is more than the bound (1 for one_step, ``max_staleness`` for bounded) weight
versions behind the learner when its step trains (a server that failed and was restarted, a slow request) is
regenerated at the current weights, with the same sampling seed, before the step uses it
(``RolloutPipeline.take``); it is never trained on. ``async/regenerated`` counts them.

Resume: the checkpoint's data position is that of the first step not yet trained (``data_state``); the rollouts
in flight when the trainer dies are not saved, their prompts are drawn again and regenerated at the
checkpoint's weights after ``--resume``, so no prompt is lost or trained twice.

The loss under staleness is the decoupled-PPO split (docs/algorithm.md, 'Asynchronous rollouts'): the behaviour
log-probs are the sampler's (per token, from the version that sampled it), the proximal ones the learner's aligned
quantized forward at the current weights; ``mismatch_split`` measures the two parts of their difference.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_qarl.algo.mismatch import mismatch_metrics
from megatron_qarl.config import QarlConfig
from megatron_qarl.data.prompts import PromptSample, PromptStream
from megatron_qarl.rollout.manager import EveryServerDown, RolloutManager, RoutesSpec, Sample
from megatron_qarl.train.rollouts import TrainRollouts


def version_number(version: str | None) -> int | None:
    """The trainer's weight versions are ``v<n>`` (sync/broadcaster.py); anything else (``default``: a server
    that never received the learner's weights) is None, of unknown age."""
    if version and version.startswith("v") and version[1:].isdigit():
        return int(version[1:])
    return None


def token_staleness(sample: Sample, learner_version: int) -> list[int | None]:
    """Per response token: learner_version - the version that sampled it (None: unknown version)."""
    return [None if (n := version_number(v)) is None else learner_version - n for v in sample.versions()]


def sample_staleness(sample: Sample, learner_version: int) -> int | None:
    """The oldest token's staleness (None if any token's version is unknown)."""
    ages = token_staleness(sample, learner_version)
    return None if any(a is None for a in ages) else max(ages, default=0)


def staleness_metrics(groups: list[list[Sample]], learner_version: int, bound: int) -> tuple[dict[str, float],
                                                                                             list[int]]:
    """staleness/token_frac_<k> (k = 0..bound: the fraction of response tokens k versions behind the learner),
    staleness/token_mean, staleness/token_max, staleness/samples_spanning (samples whose tokens come from more
    than one version); and every token's staleness (the TensorBoard histogram)."""
    ages = [a for g in groups for s in g for a in token_staleness(s, learner_version)]
    if any(a is None for a in ages):
        raise ValueError("staleness_metrics: a sample of unknown weight version reached training")
    n = max(len(ages), 1)
    m = {f"staleness/token_frac_{k}": sum(a == k for a in ages) / n for k in range(bound + 1)}
    m["staleness/token_mean"] = sum(ages) / n
    m["staleness/token_max"] = float(max(ages, default=0))
    m["staleness/samples_spanning"] = float(sum(len(set(s.versions())) > 1 for g in groups for s in g))
    return m, ages


def rescored_BT(groups: list[list[Sample]], rescored: list[list[float]], shape: tuple[int, int]) -> torch.Tensor:
    """The servers' rescored log-probs placed like build_batch's logp_sampler_BT (logp[t] scores token t+1)."""
    out = torch.zeros(shape)
    for i, (s, lp) in enumerate(zip([s for g in groups for s in g], rescored, strict=True)):
        start = len(s.prompt_ids) - 1
        out[i, start: start + len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


def mismatch_split(logp_old_BT: torch.Tensor, logp_old_unscaled_BT: torch.Tensor, logp_rescored_BT: torch.Tensor,
                   logp_sampler_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """The learner-sampler mismatch d = logp_old - logp_sampler split exactly in two, d = d_quant + d_stale.

    logp_old and logp_sampler are log_softmax(z / T) (the loss's; the sampler's output log-probs, SGLang's default).
    The servers' rescore reads SGLang's input_token_logprobs, which are log_softmax(z) at any T (serve/sampling.py),
    so it is compared with the learner's unscaled log-probs ``logp_old_unscaled`` (= logp_old at T = 1):

        d_quant = logp_old_unscaled - logp_rescored   learner vs server at the SAME weights (the learner's) and the
                                                      same semantics: quantization and kernel numerics, what QaRL's
                                                      alignment removes
        d_stale = d - d_quant                         the rest: (logp_rescored + logp_old - logp_old_unscaled)
                                                      - logp_sampler, the server's rescore carried to temperature T
                                                      by the learner's shift, vs the versions that sampled: the
                                                      policy change over the staleness

    At T = 1 these are logp_old - logp_rescored and logp_rescored - logp_sampler. Returns mismatch_quant/* and
    mismatch_stale/* (algo/mismatch.py's statistics of each part)."""
    m = {f"mismatch_quant/{k}": float(v) for k, v in mismatch_metrics(logp_old_unscaled_BT, logp_rescored_BT,
                                                                       mask_BT).items()}
    at_t_BT = logp_rescored_BT + logp_old_BT - logp_old_unscaled_BT
    m.update({f"mismatch_stale/{k}": float(v) for k, v in mismatch_metrics(at_t_BT, logp_sampler_BT,
                                                                            mask_BT).items()})
    return m


def kv_cache_split(logp_aligned_BT: torch.Tensor, logp_unaware_BT: torch.Tensor,
                   mask_BT: torch.Tensor) -> dict[str, float]:
    """The FP8 KV cache's part of d_quant (``mismatch_split``; rollout.kv_cache_dtype with learner.aligned): the
    learner's unscaled log-probs on the keys and values the servers' cache reads back (``logp_aligned``, those of
    d_quant) against those on its own (``logp_unaware``, one more forward at the same weights), d_kv = logp_unaware
    - logp_aligned = d_quant(unaware learner) - d_quant(aligned): what the cache's rounding would add to the
    quantization part without the alignment. Returns mismatch_kv/* (algo/mismatch.py's statistics)."""
    return {f"mismatch_kv/{k}": float(v) for k, v in mismatch_metrics(logp_unaware_BT, logp_aligned_BT,
                                                                       mask_BT).items()}


@dataclasses.dataclass
class Rollout:
    """One step's rollout: its prompts (and the data position before them), its samples once done."""

    step: int
    prompts: list[PromptSample]
    data_before: dict
    manager: RolloutManager | None = None
    groups: list[list[Sample]] | None = None
    future: Future | None = None
    busy_s: float = 0.0  # seconds the rollout itself ran (in the background: overlapped with training)
    regenerated: int = 0  # samples over the staleness bound, sampled again


class RolloutPipeline:
    """Each step's rollout under ``train.async``. The trainer calls, per step: ``take(step)`` (the rollout,
    waited for, the bound enforced), ``ahead(step)`` (start the next ones), ``before_sync()`` (one_step: wait for
    them) and saves ``data_state()`` in checkpoints. ``version`` gives the learner's current weight version."""

    def __init__(self, cfg: QarlConfig, rollouts: TrainRollouts, stream: PromptStream, routes: RoutesSpec | None,
                 version: Callable[[], int]):
        self.cfg, self.rollouts, self.stream, self.routes, self.version = cfg, rollouts, stream, routes, version
        self.mode = cfg.train.async_mode
        self.bound = cfg.train.staleness_bound
        self.pending: dict[int, Rollout] = {}
        self.pool = (ThreadPoolExecutor(max_workers=self.bound, thread_name_prefix="qarl-rollout")
                     if self.mode != "off" else None)

    # ------------------------------------------------------------------------------------- the step
    def take(self, step: int) -> Rollout:
        """Step ``step``'s rollout: the one in flight (waited for), else one run now. In async modes, samples
        over the bound are regenerated (``Rollout.regenerated``)."""
        job = self.pending.get(step)
        if job is None:
            job = self._draw(step)
            self._run(job, background=False)
        else:  # pending until its result is in: a signal that interrupts the wait leaves it for close(abort) to cancel
            try:
                job.future.result()
            except EveryServerDown:  # every server failed in the background: restart them here and continue
                self._run(job, background=False)
            del self.pending[step]
        if self.mode != "off":
            self._enforce_bound(job)
        return job

    def ahead(self, step: int) -> None:
        """Start the rollouts of steps step+1 .. step+bound (up to train.steps) not yet in flight."""
        if self.mode == "off":
            return
        for s in range(step + 1, min(step + self.bound, self.cfg.train.steps) + 1):
            if s not in self.pending:
                job = self._draw(s)
                job.future = self.pool.submit(self._run, job, True)
                self.pending[s] = job

    def before_sync(self) -> None:
        """one_step: the sync waits for the rollouts in flight (none spans a sync; their errors wait for
        ``take``). bounded: nothing (the sync retracts running requests)."""
        if self.mode == "one_step":
            for job in self.pending.values():
                job.future.exception()

    def data_state(self) -> dict:
        """The data position a checkpoint saves: before the first rollout not yet trained on."""
        if self.pending:
            return self.pending[min(self.pending)].data_before
        return self.stream.state_dict()

    def close(self, abort: bool = False) -> None:
        """End the background rollouts (their servers may be going down: errors are dropped). After a run that
        finished none is in flight. ``abort`` (the run ends on an error or a stop signal): they are cancelled, not
        waited for: a request retracted on a server that stayed paused would hold this for rollout.timeout_s x
        retries, whole rollouts up to train.max_staleness of them, and nothing they sample is trained on."""
        for job in self.pending.values():
            if abort:
                job.future.cancel()  # not started yet
                job.manager.cancel()
            if not job.future.cancelled():
                job.future.exception()
        self.pending.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ------------------------------------------------------------------------------------ internals
    def _draw(self, step: int) -> Rollout:
        before = self.stream.state_dict()
        # a request aborted by a sync is continued (R3 in bounded mode; a restart's sync in the others); a rollout in
        # flight sees at most bound + 1 syncs, so more aborts in a row without output are a failing server
        manager = RolloutManager(self.cfg.rollout.sampling, self.rollouts.stop_ids, seed=self.cfg.seed,
                                 routes=self.routes, max_idle_aborts=self.bound + 1)
        return Rollout(step, self.stream.next_batch(self.cfg.train.prompts_per_step), before, manager)

    def _run(self, job: Rollout, background: bool) -> None:
        t0 = time.perf_counter()
        try:
            job.groups, _ = self.rollouts.rollout([p.prompt_ids for p in job.prompts], self.cfg.rollout.sampling,
                                                  job.step, self.routes, manager=job.manager,
                                                  restart=not background)
        finally:
            job.busy_s += time.perf_counter() - t0

    def _enforce_bound(self, job: Rollout) -> None:
        """Samples with a token more than ``bound`` versions behind the learner (or of unknown version) are
        dropped from the rollout and sampled again now, at the current weights, with their own seeds."""
        now = self.version()
        stale = [(s.prompt_index, s.sample_index) for g in job.groups for s in g
                 if (age := sample_staleness(s, now)) is None or age > self.bound]
        if not stale:
            return
        for key in stale:
            del job.manager.finished[key]
        job.regenerated += len(stale)
        self._run(job, background=False)
