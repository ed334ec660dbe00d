"""The trainer's evaluation: greedy (and, with ``train.eval.sampled_n``, sampled) accuracy on held-out
prompts, and the ``train.save_log_ratios`` files written at each evaluation."""

from __future__ import annotations

import time
from pathlib import Path

from megatron_qarl.config import QarlConfig
from megatron_qarl.data.math_task import heldout_problems
from megatron_qarl.data.prompts import PromptStream, render_prompt, tokenize, uses_chat_template
from megatron_qarl.data.reward import RewardScorer
from megatron_qarl.rollout.manager import Sample, SamplingConfig
from megatron_qarl.train.rollouts import TrainRollouts

EVAL_SEED_OFFSET = 1 << 20  # eval sampling seeds never collide with training ones


def response_texts(tokenizer, groups: list[list[Sample]]) -> list[str]:
    return tokenizer.batch_decode([s.response_ids for g in groups for s in g], skip_special_tokens=True)


class Evaluation:
    """Held-out accuracy from the rollout servers; ``log_ratios`` collects each step's per-token
    logp_old - logp_sampler until the next evaluation writes them."""

    def __init__(self, cfg: QarlConfig, tokenizer, scorer: RewardScorer, rollouts: TrainRollouts, out: Path):
        self.cfg, self.tokenizer, self.scorer, self.rollouts, self.out = cfg, tokenizer, scorer, rollouts, out
        self._prompts = None
        self.log_ratios: list = []

    def prompts(self) -> tuple[list[list[int]], list[str]]:
        """(prompt token ids, answers) of the held-out set, built once."""
        if self._prompts is None:
            ev = self.cfg.train.eval
            if ev.data is None:
                task = self.cfg.data.synthetic
                problems = heldout_problems(task, min(ev.n, task.heldout_size))
                templated = uses_chat_template(self.tokenizer, self.cfg.data)
                texts = [render_prompt([{"role": "user", "content": p.prompt}], self.tokenizer, self.cfg.data,
                                       templated) for p in problems]
                self._prompts = (tokenize(texts, self.tokenizer, templated), [p.answer for p in problems])
            else:
                rows = PromptStream(ev.data.model_copy(update={"shuffle": False}), self.tokenizer)
                n = min(ev.n, rows.num_prompts or ev.n)
                batch = rows.next_batch(n)
                self._prompts = ([p.prompt_ids for p in batch], [p.answer for p in batch])
        return self._prompts

    def run(self, step: int) -> dict[str, float]:
        """eval/greedy_accuracy (and eval/sampled_accuracy), time/eval_s; writes the log ratios of ``step``."""
        ev = self.cfg.train.eval
        prompts, answers = self.prompts()
        out = {}
        start = time.perf_counter()
        greedy = SamplingConfig(n_samples=1, temperature=0.0, max_new_tokens=ev.max_new_tokens)
        groups, _ = self.rollouts.rollout(prompts, greedy, EVAL_SEED_OFFSET + step)
        rewards, _ = self.scorer.score(response_texts(self.tokenizer, groups), answers)
        out["eval/greedy_accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
        if ev.sampled_n:
            sampled = SamplingConfig(n_samples=ev.sampled_n, temperature=ev.temperature,
                                     max_new_tokens=ev.max_new_tokens)
            groups, _ = self.rollouts.rollout(prompts, sampled, EVAL_SEED_OFFSET + step)
            rewards, _ = self.scorer.score(response_texts(self.tokenizer, groups),
                                           [a for a in answers for _ in range(ev.sampled_n)])
            out["eval/sampled_accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
        out["time/eval_s"] = time.perf_counter() - start
        self.write_log_ratios(step)
        return out

    def write_log_ratios(self, step: int) -> None:
        """train.save_log_ratios: the response tokens' logp_old - logp_sampler of every step since the last
        evaluation, as one float32 .npy: log_ratios/step_NNNNNN.npy (NNNNNN: this evaluation's step)."""
        if not self.log_ratios:
            return
        import numpy as np

        d = self.out / "log_ratios"
        d.mkdir(exist_ok=True)
        np.save(d / f"step_{step:06d}.npy", np.concatenate(self.log_ratios).astype(np.float32))
        self.log_ratios = []
