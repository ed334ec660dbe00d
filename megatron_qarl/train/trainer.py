"""The QaRL loop. One on-policy step:

    prompts -> G samples each from the rollout servers (with the sampler's log-probs)
            -> rewards (math-verify, with timeouts) -> group advantages
            -> the learner's aligned forward: logp_old
            -> policy update (TBPO or the configured baseline) -> weight sync -> next step

The trainer is the driver: it holds the data stream, the reward workers and the metrics, and calls
the learner ranks and rollout servers through megatron_qarl/launch/'s LearnerRanks and ServerFleet, so the same
loop runs in one process on a laptop and on a Ray cluster started by Slurm.

Its rooms, beside it in train/: rollouts.py (rollouts with server failover, restarts and the weight sync),
pipeline.py (``train.async``: whether a step's rollout runs in line or overlaps the previous steps' training, the
staleness bound, the mismatch split), evaluation.py (held-out evaluation, log ratios), metrics.py (a step's
metrics), tracking.py (TensorBoard, JSONL, plots); this module holds the step and the run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path

import torch

from megatron_qarl.algo.advantages import group_advantages
from megatron_qarl.algo.mismatch import mismatch_metrics
from megatron_qarl.algo.routing import routes_batch, routing_agreement
from megatron_qarl.config import QarlConfig
from megatron_qarl.data.prompts import PromptStream
from megatron_qarl.data.reward import RewardScorer, shuffle_rewards_in_groups
from megatron_qarl.errors import UserError
from megatron_qarl.launch.fleet import LearnerRanks, ServerFleet
from megatron_qarl.learner import checkpoint as ckpt
from megatron_qarl.learner.packing import loss_lengths
from megatron_qarl.learner.rank import Batch
from megatron_qarl.rollout.manager import RoutesSpec, Sample
from megatron_qarl.train.evaluation import Evaluation, response_texts
from megatron_qarl.train.metrics import scalar, step_metrics
from megatron_qarl.train.pipeline import (
    RolloutPipeline,
    kv_cache_split,
    mismatch_split,
    rescored_BT,
    staleness_metrics,
)
from megatron_qarl.train.rollouts import TrainingAborted, TrainRollouts
from megatron_qarl.train.tracking import Tracker


class StopRequested(Exception):
    """A stop was asked for (``Trainer.run``'s ``stop`` event): the run ended at a step boundary, checkpointed."""


@dataclasses.dataclass
class TrainerState:
    """Everything besides learner shards that a resumed run needs (saved as JSON in each checkpoint)."""

    step: int = 0  # steps completed
    weight_version: int = 0
    data: dict[str, int] = dataclasses.field(default_factory=dict)
    nonfinite_in_row: int = 0
    nonfinite_total: int = 0
    server_failures: int = 0
    resent: int = 0
    reward_timeouts: int = 0


def build_batch(groups: list[list[Sample]], pad_id: int) -> tuple[Batch, torch.Tensor]:
    """Right-padded prompt+response tokens [B, S] and, aligned with the learner's log-probs [B, S-1],
    the response-token mask and the sampler's log-probs. Returns (batch without extras, logp_sampler_BT)."""
    samples = [s for g in groups for s in g]
    seq = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    seq = max(seq, 2)
    B = len(samples)
    tokens = torch.full((B, seq), pad_id, dtype=torch.long)
    mask = torch.zeros(B, seq - 1)
    logp_sampler = torch.zeros(B, seq - 1)
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        tokens[i, : len(ids)] = torch.tensor(ids)
        start, n = len(s.prompt_ids) - 1, len(s.response_ids)  # logp[t] scores token t+1
        mask[i, start : start + n] = 1.0
        logp_sampler[i, start : start + n] = torch.tensor(s.logp_sampler, dtype=torch.float32)
    return Batch(tokens, mask), logp_sampler


class Trainer:
    def __init__(self, cfg: QarlConfig, learners: LearnerRanks, servers: ServerFleet, *, tokenizer,
                 resume: bool | str | Path = False, progress: bool = True, stream: PromptStream | None = None):
        """``resume``: True continues from the newest checkpoint of the output dir, a path from that checkpoint
        (``qarl train`` checks it first: ``learner.checkpoint.resume_point``)."""
        self.cfg, self.learners, self.servers = cfg, learners, servers
        self.tokenizer = tokenizer
        self.out = Path(cfg.train.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        self.stream = stream or PromptStream(cfg.data, tokenizer)
        self.state = TrainerState()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if resume:
            path = ckpt.latest(self.ckpt_root) if resume is True else Path(resume)
            if path is None:
                raise UserError(f"--resume: no checkpoint in {self.ckpt_root}")
            saved = ckpt.read_state(path)
            self.state = TrainerState(**saved["trainer"])
            self.stream.load_state_dict(self.state.data)
            # the start sync re-sends the checkpoint's weights: under the checkpoint's version, not a new one
            learners.load(str(path), self.state.weight_version - 1)
        self.progress = progress
        self.tracker: Tracker | None = None
        self.scorer = RewardScorer(cfg.reward)
        self.rollouts = TrainRollouts(cfg, learners, servers, stop_ids, on_sync=self._synced,
                                      console=lambda text: self.tracker.console(text))
        self.evaluation = Evaluation(cfg, tokenizer, self.scorer, self.rollouts, self.out)
        self.routes: RoutesSpec | None = None  # R3: what the training rollouts return besides tokens
        if cfg.algo.wants_routes:
            from megatron_qarl.moe.model import Qwen3MoeArch

            arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
            self.routes = RoutesSpec(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts)
        self.pipeline = RolloutPipeline(cfg, self.rollouts, self.stream, self.routes,
                                        version=lambda: self.state.weight_version)
        self.staleness: list[int] = []  # the last step's per-token staleness (TensorBoard histogram)

    def _synced(self, report: dict) -> None:
        self.state.weight_version = int(report["weight_version"].lstrip("v"))

    def evaluate(self) -> dict[str, float]:
        return self.evaluation.run(self.state.step)

    # --------------------------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        cfg, st = self.cfg, self.state
        step = st.step + 1
        m: dict[str, float] = {}
        t0 = time.perf_counter()
        job = self.pipeline.take(step)  # off: sampled now; async: sampled while earlier steps trained
        prompts, groups, manager = job.prompts, job.groups, job.manager
        t_rescore_start = time.perf_counter()
        rescored = None
        if cfg.train.async_mode != "off" and cfg.train.mismatch_split:
            # the servers hold the learner's version; before ahead() (one_step: they are idle, no queueing behind
            # the next rollout's requests)
            rescored = self.rollouts.rescore(groups)
        t_rescore = time.perf_counter()
        self.pipeline.ahead(step)  # async: the next steps' rollouts start now, at the current weights
        if cfg.train.async_mode != "off":
            stale, self.staleness = staleness_metrics(groups, st.weight_version, cfg.train.staleness_bound)
            m.update(stale)
            m["async/regenerated"] = float(job.regenerated)
            m["async/continued"] = float(manager.continued)  # requests aborted by a sync, continued
            m["async/rollout_busy_s"] = job.busy_s
        t_rollout = time.perf_counter()
        G = cfg.rollout.sampling.n_samples
        texts = response_texts(self.tokenizer, groups)
        rewards, rstats = self.scorer.score(texts, [p.answer for p in prompts for _ in range(G)])
        # reward.shuffle (control runs): the update sees each group's rewards in a random order; the
        # reward/* metrics stay the true ones
        train_rewards = shuffle_rewards_in_groups(rewards, G, cfg.seed, step) if cfg.reward.shuffle else rewards
        t_reward = time.perf_counter()

        batch, logp_sampler_BT = build_batch(groups, self.pad_id)
        if self.routes is None:
            logp_old_BT = self.learners.logprobs(batch.tokens_BS, lengths=loss_lengths(batch.loss_mask_BT))
        else:
            logp_old_BT = self._routing(groups, batch, logp_sampler_BT, m)
        if rescored is not None:
            m.update(self._mismatch_split(groups, rescored, batch, logp_old_BT, logp_sampler_BT))
        t_logp = time.perf_counter()
        adv_B = group_advantages(train_rewards, G, cfg.algo.advantage).float()
        batch.extra.update(adv_B=adv_B, logp_old_BT=logp_old_BT, logp_sampler_BT=logp_sampler_BT)
        loss_metrics = self.learners.train(batch, cfg.algo.loss, step in cfg.train.inject_nonfinite_steps)
        t_update = time.perf_counter()
        self._count_nonfinite(step, loss_metrics)
        self.pipeline.before_sync()  # one_step: the next rollout ends before the weights change
        t_wait = time.perf_counter()

        st.server_failures += manager.server_failures
        st.resent += manager.resent
        st.reward_timeouts += int(rstats.get("timeouts", 0))
        if self.rollouts.heal() or manager.server_failures:
            self.rollouts.connect()
        report = self.rollouts.sync()
        t_sync = time.perf_counter()

        if cfg.train.save_log_ratios:
            self.evaluation.log_ratios.append((logp_old_BT - logp_sampler_BT)[batch.loss_mask_BT > 0].float().numpy())
        times = {"rollout": t_rescore_start - t0, "rescore": t_rescore - t_rescore_start,
                 "reward": t_reward - t_rollout, "logp": t_logp - t_reward, "update": t_update - t_logp,
                 "rollout_wait": t_wait - t_update, "sync": t_sync - t_wait}
        m.update(step_metrics(groups, texts, rewards, rstats, batch.loss_mask_BT, logp_old_BT, logp_sampler_BT,
                              loss_metrics, times, report, len(prompts) * G - sum(len(g) for g in groups)))
        if cfg.train.async_mode != "off":  # the rollout ran in the background: its own seconds, not the wait
            m["throughput/rollout_tokens_per_s"] = float(batch.loss_mask_BT.sum()) / max(job.busy_s, 1e-9)
        m["sync/weight_version"] = float(st.weight_version)
        m["faults/nonfinite_total"] = float(st.nonfinite_total)
        m["faults/server_failures"] = float(st.server_failures)
        m["faults/resent_requests"] = float(st.resent)
        m["faults/reward_timeouts_total"] = float(st.reward_timeouts)
        st.step = step
        st.data = self.pipeline.data_state()  # async: before the prompts of rollouts still in flight
        return m

    def _mismatch_split(self, groups: list[list[Sample]], rescored: list[list[float]], batch: Batch,
                        logp_old_BT: torch.Tensor, logp_sampler_BT: torch.Tensor) -> dict[str, float]:
        """train/pipeline.py's mismatch split of this step. The servers' rescore is of the unscaled distribution
        (SGLang's input log-probs), so the learner's side of it is too: logp_old itself at temperature 1, else one
        more aligned forward at temperature 1 (with the same replayed routes under R3)."""
        unscaled_BT = logp_old_BT if self.cfg.rollout.sampling.temperature == 1.0 else self.learners.logprobs(
            batch.tokens_BS, batch.extra.get("routes_BSLK"), temperature=1.0, lengths=loss_lengths(batch.loss_mask_BT))
        m = mismatch_split(logp_old_BT, unscaled_BT, rescored_BT(groups, rescored, tuple(logp_sampler_BT.shape)),
                           logp_sampler_BT, batch.loss_mask_BT)
        if self.cfg.rollout.kv_cache_dtype != "auto" and self.cfg.learner.aligned:  # the FP8 KV cache's part
            unaware_BT = self.learners.logprobs(batch.tokens_BS, batch.extra.get("routes_BSLK"), temperature=1.0,
                                                lengths=loss_lengths(batch.loss_mask_BT), kv_cache=False)
            m.update(kv_cache_split(unscaled_BT, unaware_BT, batch.loss_mask_BT))
        return m

    def _count_nonfinite(self, step: int, loss_metrics: dict[str, float]) -> None:
        """A skipped update (non-finite loss or gradient) counts; train.max_nonfinite_in_row of them in a row
        abort the run."""
        st, limit = self.state, self.cfg.train.max_nonfinite_in_row
        skipped = loss_metrics.get("skipped", 0.0) > 0
        st.nonfinite_total += int(skipped)
        st.nonfinite_in_row = st.nonfinite_in_row + 1 if skipped else 0
        if st.nonfinite_in_row >= limit:
            raise TrainingAborted(f"step {step}: {st.nonfinite_in_row} steps in a row had a non-finite loss or "
                                  f"gradient (limit train.max_nonfinite_in_row={limit}); lower optim.lr or check "
                                  "the data")

    def _routing(self, groups: list[list[Sample]], batch: Batch, logp_sampler_BT: torch.Tensor,
                 m: dict[str, float]) -> torch.Tensor:
        """R3: the aligned log-probs (replaying the servers' routes with ``algo.routing_replay``, which the
        update then replays too) and the routing/* metrics: how often the learner routing on its own picks
        the servers' experts, and the mismatch it would have without replay."""
        samples = [s for g in groups for s in g]
        r = self.routes
        server_BSLK = routes_batch([s.routes for s in samples], batch.tokens_BS.shape[1], r.layers, r.topk)
        replay = self.cfg.algo.routing_replay
        out = self.learners.routing_logprobs(batch.tokens_BS, server_BSLK if replay else None)
        mask = batch.loss_mask_BT
        m.update({f"routing/{k}": v for k, v in routing_agreement(out["routes_BSLK"], server_BSLK, mask).items()})
        free = mismatch_metrics(out["logp_free_BT"], logp_sampler_BT, mask)
        m["routing/mismatch_free_tok_abs_mean"] = scalar(free["mismatch_tok_abs_mean"])
        m["routing/bytes_returned"] = float(sum(s.routes.numel() * 4 for s in samples))
        if not replay:
            return out["logp_free_BT"]
        used = routing_agreement(out["replayed_BSLK"], server_BSLK, mask)  # what the routers received
        m["routing/replayed_agree_token"] = used["agree_token"]
        batch.extra["routes_BSLK"] = server_BSLK
        return out["logp_replay_BT"]

    def save(self) -> Path:
        tmp = ckpt.tmp_dir(self.ckpt_root, self.state.step)
        self.learners.save(str(tmp))
        return ckpt.commit(self.ckpt_root, self.state.step,
                           {"trainer": dataclasses.asdict(self.state), "config": self.cfg.model_dump(mode="json")},
                           self.cfg.train.checkpoint.keep)

    def _stop(self) -> None:
        """End the run at this step boundary: checkpoint the last finished step unless it has a checkpoint, then
        raise StopRequested. Slurm's USR1 before the time limit, or a preemption's SIGTERM, costs no finished step."""
        latest = ckpt.latest(self.ckpt_root)
        if self.state.step and (latest is None or latest != ckpt.step_dir(self.ckpt_root, self.state.step)):
            self.save()
        raise StopRequested(f"stopped on a signal after step {self.state.step} (checkpoint saved; --resume continues)")

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Train to ``train.steps``; returns the last step's metrics plus the first and last evaluation. Once
        ``stop`` is set, the run ends at the next step boundary with a checkpoint (StopRequested)."""
        cfg = self.cfg
        tc = cfg.train
        self.tracker = Tracker(self.out, start_step=self.state.step, total=tc.steps, progress=self.progress)
        self.rollouts.connect()
        self.rollouts.sync()  # servers start from the initial checkpoint: push the learner's (possibly resumed) weights
        summary: dict[str, float] = {}
        ev = tc.eval
        if self.state.step == 0:
            first = self.evaluate()
            self.tracker.log(0, first)
            summary.update({f"start/{k}": v for k, v in first.items()})
        try:
            while self.state.step < tc.steps:
                if stop is not None and stop.is_set():
                    self._stop()
                metrics = self.step()
                step = self.state.step
                if (ev.every and step % ev.every == 0) or step == tc.steps:
                    metrics.update(self.evaluate())
                self.tracker.log(step, metrics)  # before the checkpoint: a crash between the two redoes the step
                if self.staleness:
                    self.tracker.histogram(step, "staleness/tokens", self.staleness)
                summary.update(metrics)
                ck = tc.checkpoint
                if (ck.every and step % ck.every == 0) or step == tc.steps:
                    t = time.perf_counter()
                    self.save()
                    self.tracker.log(step, {"time/checkpoint_s": time.perf_counter() - t}, jsonl=False)
        except BaseException:  # an error or a stop signal: the rollouts in flight are never trained on
            self.pipeline.close(abort=True)
            raise
        else:
            self.pipeline.close()
        finally:
            self.tracker.close()
        return summary

    def close(self) -> None:
        self.scorer.close()


def write_summary(path: Path, summary: dict[str, float]) -> None:
    path.write_text(json.dumps({k: (v if math.isfinite(v) else str(v)) for k, v in summary.items()}, indent=1,
                               sort_keys=True))
