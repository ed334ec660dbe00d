"""The QaRL loop. One on-policy step:

    prompts -> G samples each from the rollout servers (with the sampler's log-probs)
            -> rewards (math-verify, with timeouts) -> group advantages
            -> the learner's aligned forward: logp_old
            -> policy update (TBPO or the configured baseline) -> weight sync -> next step

The trainer is the driver: it holds the data stream, the reward workers and the metrics, and calls
the learner ranks and rollout servers through megatron_qarl/launch/'s LearnerRanks and ServerFleet, so the same
loop runs in one process on a laptop and on a Ray cluster started by Slurm.

Server faults are steps of the loop too: a server that fails mid-rollout is dropped and its requests go to the
others; when the last one fails, the rollout stops, the servers are restarted and get the current weights, and
the missing requests are sent again (``_rollout``). Dead servers are restarted after each step, before the sync.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import torch

from megatron_qarl import checkpoint as ckpt
from megatron_qarl.algo.advantages import group_advantages
from megatron_qarl.algo.error_tokens import error_token_metrics, error_token_stats
from megatron_qarl.algo.mismatch import mismatch_metrics
from megatron_qarl.algo.routing import routes_batch, routing_agreement
from megatron_qarl.config import QarlConfig
from megatron_qarl.data.math_task import heldout_problems
from megatron_qarl.data.prompts import PromptStream, render_prompt, tokenize, uses_chat_template
from megatron_qarl.data.reward import RewardScorer, shuffle_rewards_in_groups
from megatron_qarl.errors import UserError
from megatron_qarl.launch.fleet import LearnerRanks, ServerFleet
from megatron_qarl.learner import Batch
from megatron_qarl.rollout.client import ClientConfig, SGLangClient
from megatron_qarl.rollout.manager import EveryServerDown, RolloutManager, RoutesSpec, Sample, SamplingConfig
from megatron_qarl.tracking import Tracker

EVAL_SEED_OFFSET = 1 << 20  # eval sampling seeds never collide with training ones


class TrainingAborted(UserError):
    """The run cannot go on (too many non-finite steps in a row, every rollout server gone, ...)."""


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


def _scalar(v: Any) -> float:
    return float(v.item() if torch.is_tensor(v) else v)


class Trainer:
    def __init__(self, cfg: QarlConfig, learners: LearnerRanks, servers: ServerFleet, *, tokenizer,
                 resume: bool = False, progress: bool = True, stream: PromptStream | None = None):
        self.cfg, self.learners, self.servers = cfg, learners, servers
        self.tokenizer = tokenizer
        self.out = Path(cfg.train.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        self.stream = stream or PromptStream(cfg.data, tokenizer)
        self.state = TrainerState()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if resume:
            path = ckpt.latest(self.ckpt_root)
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
        self._eval_set = None
        self._log_ratios: list = []  # train.save_log_ratios: per-token logp_old - logp_sampler since the last eval
        self.routes: RoutesSpec | None = None  # R3: what the training rollouts return besides tokens
        if cfg.algo.wants_routes:
            from megatron_qarl.moe.model import Qwen3MoeArch

            arch = Qwen3MoeArch.from_model_dir(cfg.model.path)
            self.routes = RoutesSpec(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts)

    # ---------------------------------------------------------------------------------- plumbing
    def _client(self, url: str) -> SGLangClient:
        r = self.cfg.rollout
        conf = ClientConfig(timeout_s=r.timeout_s, retries=r.retries, max_concurrency=r.max_concurrency)
        return SGLangClient(url, api_key=r.api_key, config=conf)

    def _live(self) -> list[int]:
        return [i for i, a in enumerate(self.servers.alive()) if a]

    def _generate(self, manager: RolloutManager, prompts: list[list[int]], seed_step: int,
                  live: list[int]) -> list[list[Sample]]:
        """One round of ``manager``'s requests to the ``live`` servers (clients live as long as the round)."""

        async def run():
            clients = [self._client(self.servers.urls[i]) for i in live]
            try:
                return await manager.generate(clients, prompts, seed_step)
            finally:
                for c in clients:
                    await c.close()

        return asyncio.run(run())

    def _rollout(self, prompts: list[list[int]], sampling: SamplingConfig, seed_step: int,
                 routes: RoutesSpec | None = None) -> tuple[list[list[Sample]], RolloutManager]:
        """G samples per prompt from the live servers. A server that fails is dropped for this rollout and its
        requests go to the others; when every one has failed (rollout.restart_dead), the servers are restarted,
        get the current weights, and the requests that did not finish are sent again."""
        manager = RolloutManager(sampling, self.stop_ids, seed=self.cfg.seed, routes=routes)
        live = self._live()
        if not live:
            raise TrainingAborted("every rollout server is down")
        while True:
            try:
                return self._generate(manager, prompts, seed_step, live), manager
            except EveryServerDown:
                if not self.cfg.rollout.restart_dead:
                    raise
            for i in live:  # each one failed this round: dead, or running but not answering
                self.tracker.console(f"restarting rollout server {i} ({self.servers.urls[i]}) mid-rollout "
                                     f"({len(manager.finished)} samples finished)")
                self.servers.restart(i)
            self._heal_servers()  # any that were down before this rollout
            self._connect()
            self._sync()
            live = self._live()

    def _connect(self) -> None:
        """(Re)create the weight-update group with every live server and push the current weights."""
        self.learners.set_engines(list(self.servers.urls), max(1, self.cfg.rollout.gpus_per_server),
                                  self.cfg.rollout.api_key)

    def _heal_servers(self) -> bool:
        """Restart (or drop) dead servers; True when the weight group must be rebuilt."""
        alive = self.servers.alive()
        if all(alive):
            return False
        if not self.cfg.rollout.restart_dead:
            dead = [u for u, a in zip(self.servers.urls, alive, strict=True) if not a]
            raise TrainingAborted(f"rollout servers {dead} died and rollout.restart_dead is false")
        for i, ok in enumerate(alive):
            if not ok:
                self.tracker.console(f"restarting rollout server {i} ({self.servers.urls[i]})")
                self.servers.restart(i)
        return True

    def _sync(self) -> dict:
        report = self.learners.sync()
        self.state.weight_version = int(report["weight_version"].lstrip("v"))
        return report

    # --------------------------------------------------------------------------------------- eval
    def _eval_prompts(self) -> tuple[list[list[int]], list[str]]:
        if self._eval_set is None:
            ev = self.cfg.train.eval
            if ev.data is None:
                task = self.cfg.data.synthetic
                problems = heldout_problems(task, min(ev.n, task.heldout_size))
                templated = uses_chat_template(self.tokenizer, self.cfg.data)
                texts = [render_prompt([{"role": "user", "content": p.prompt}], self.tokenizer, self.cfg.data,
                                       templated) for p in problems]
                self._eval_set = (tokenize(texts, self.tokenizer, templated), [p.answer for p in problems])
            else:
                rows = PromptStream(ev.data.model_copy(update={"shuffle": False}), self.tokenizer)
                n = min(ev.n, rows.num_prompts or ev.n)
                batch = rows.next_batch(n)
                self._eval_set = ([p.prompt_ids for p in batch], [p.answer for p in batch])
        return self._eval_set

    def evaluate(self) -> dict[str, float]:
        ev = self.cfg.train.eval
        prompts, answers = self._eval_prompts()
        out = {}
        start = time.perf_counter()
        greedy = SamplingConfig(n_samples=1, temperature=0.0, max_new_tokens=ev.max_new_tokens)
        groups, _ = self._rollout(prompts, greedy, EVAL_SEED_OFFSET + self.state.step)
        rewards, _ = self.scorer.score(self._texts(groups), answers)
        out["eval/greedy_accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
        if ev.sampled_n:
            sampled = SamplingConfig(n_samples=ev.sampled_n, temperature=ev.temperature,
                                     max_new_tokens=ev.max_new_tokens)
            groups, _ = self._rollout(prompts, sampled, EVAL_SEED_OFFSET + self.state.step)
            rewards, _ = self.scorer.score(self._texts(groups), [a for a in answers for _ in range(ev.sampled_n)])
            out["eval/sampled_accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
        out["time/eval_s"] = time.perf_counter() - start
        self._write_log_ratios()
        return out

    def _write_log_ratios(self) -> None:
        """train.save_log_ratios: the response tokens' logp_old - logp_sampler of every step since the last
        evaluation, as one float32 .npy: log_ratios/step_NNNNNN.npy (NNNNNN: this evaluation's step)."""
        if not self._log_ratios:
            return
        import numpy as np

        d = self.out / "log_ratios"
        d.mkdir(exist_ok=True)
        np.save(d / f"step_{self.state.step:06d}.npy", np.concatenate(self._log_ratios).astype(np.float32))
        self._log_ratios = []

    def _texts(self, groups: list[list[Sample]]) -> list[str]:
        return self.tokenizer.batch_decode([s.response_ids for g in groups for s in g], skip_special_tokens=True)

    # --------------------------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        cfg, st = self.cfg, self.state
        step = st.step + 1
        m: dict[str, float] = {}
        t0 = time.perf_counter()
        prompts = self.stream.next_batch(cfg.train.prompts_per_step)
        groups, manager = self._rollout([p.prompt_ids for p in prompts], cfg.rollout.sampling, step, self.routes)
        t_rollout = time.perf_counter()
        G = cfg.rollout.sampling.n_samples
        texts = self._texts(groups)
        rewards, rstats = self.scorer.score(texts, [p.answer for p in prompts for _ in range(G)])
        # reward.shuffle (control runs): the update sees each group's rewards in a random order; the
        # reward/* metrics below stay the true ones
        train_rewards = shuffle_rewards_in_groups(rewards, G, cfg.seed, step) if cfg.reward.shuffle else rewards
        t_reward = time.perf_counter()

        batch, logp_sampler_BT = build_batch(groups, self.pad_id)
        if self.routes is None:
            logp_old_BT = self.learners.logprobs(batch.tokens_BS)
        else:
            logp_old_BT = self._routing(groups, batch, logp_sampler_BT, m)
        t_logp = time.perf_counter()
        adv_B = group_advantages(train_rewards, G, cfg.algo.advantage).float()
        batch.extra.update(adv_B=adv_B, logp_old_BT=logp_old_BT, logp_sampler_BT=logp_sampler_BT)
        poison = step in cfg.train.inject_nonfinite_steps
        loss_metrics = self.learners.train(batch, cfg.algo.loss, poison)
        t_update = time.perf_counter()

        skipped = loss_metrics.get("skipped", 0.0) > 0
        st.nonfinite_total += int(skipped)
        st.nonfinite_in_row = st.nonfinite_in_row + 1 if skipped else 0
        if st.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
            raise TrainingAborted(f"step {step}: {st.nonfinite_in_row} steps in a row had a non-finite loss or "
                                  f"gradient (limit train.max_nonfinite_in_row={cfg.train.max_nonfinite_in_row}); "
                                  "lower optim.lr or check the data")

        st.server_failures += manager.server_failures
        st.resent += manager.resent
        if self._heal_servers() or manager.server_failures:
            self._connect()
        report = self._sync()
        t_sync = time.perf_counter()

        # ------------------------------------------------------------------------------- metrics
        mask = batch.loss_mask_BT
        lengths = mask.sum(-1)
        n_tokens = float(mask.sum())
        m.update({f"loss/{k}": v for k, v in loss_metrics.items()})
        m.update({f"mismatch/{k}": _scalar(v) for k, v in mismatch_metrics(logp_old_BT, logp_sampler_BT,
                                                                            mask).items()})
        if cfg.train.save_log_ratios:
            self._log_ratios.append((logp_old_BT - logp_sampler_BT)[mask > 0].float().numpy())
        stats = error_token_stats([s.response_ids for g in groups for s in g],
                                  [s.logp_sampler for g in groups for s in g],
                                  finish_reasons=[s.finish_reason for g in groups for s in g], texts=texts)
        m.update({f"error_tokens/{k}": v for k, v in error_token_metrics(stats, rewards).items()})
        m["reward/mean"] = sum(rewards) / len(rewards)
        m["reward/accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
        m["reward/timeouts"] = float(rstats.get("timeouts", 0))
        st.reward_timeouts += int(rstats.get("timeouts", 0))
        m["length/response_mean"] = float(lengths.mean())
        m["length/response_max"] = float(lengths.max())
        m["length/truncated_frac"] = sum(s.finish_reason == "length" for g in groups for s in g) / len(lengths)
        m["time/rollout_s"] = t_rollout - t0
        m["time/reward_s"] = t_reward - t_rollout
        m["time/logp_s"] = t_logp - t_reward
        m["time/update_s"] = t_update - t_logp
        m["time/sync_s"] = t_sync - t_update
        m["time/step_s"] = t_sync - t0
        m["throughput/rollout_tokens_per_s"] = n_tokens / max(t_rollout - t0, 1e-9)
        m["throughput/tokens_per_s"] = n_tokens / max(t_sync - t0, 1e-9)
        m["sync/bytes"] = float(report["bytes"])
        m["sync/seconds"] = float(report["seconds"])
        m["sync/weight_version"] = float(st.weight_version)
        m["faults/nonfinite_total"] = float(st.nonfinite_total)
        m["faults/server_failures"] = float(st.server_failures)
        m["faults/resent_requests"] = float(st.resent)
        m["faults/prompts_lost"] = float(len(prompts) * G - sum(len(g) for g in groups))
        st.step = step
        st.data = self.stream.state_dict()
        return m

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
        m["routing/mismatch_free_tok_abs_mean"] = _scalar(free["mismatch_tok_abs_mean"])
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
        self._connect()
        self._sync()  # servers start from the initial checkpoint: push the learner's (possibly resumed) weights
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
                summary.update(metrics)
                ck = tc.checkpoint
                if (ck.every and step % ck.every == 0) or step == tc.steps:
                    t = time.perf_counter()
                    self.save()
                    self.tracker.log(step, {"time/checkpoint_s": time.perf_counter() - t}, jsonl=False)
        finally:
            self.tracker.close()
        return summary

    def close(self) -> None:
        self.scorer.close()


def write_summary(path: Path, summary: dict[str, float]) -> None:
    path.write_text(json.dumps({k: (v if math.isfinite(v) else str(v)) for k, v in summary.items()}, indent=1,
                               sort_keys=True))
