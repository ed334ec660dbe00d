"""The metrics of one training step (metrics.jsonl, TensorBoard): loss, mismatch, error tokens, reward, lengths,
time, throughput, sync and fault counters."""

from __future__ import annotations

from typing import Any

import torch

from megatron_qarl.algo.error_tokens import error_token_metrics, error_token_stats
from megatron_qarl.algo.mismatch import mismatch_metrics
from megatron_qarl.rollout.manager import Sample


def scalar(v: Any) -> float:
    return float(v.item() if torch.is_tensor(v) else v)


def padding_metrics(lengths: list[int], loss_tokens: float) -> dict[str, float]:
    """What the learner's right-padded batch computes for nothing (trainer.build_batch pads every row to the longest,
    and its micro-batches keep that width): with B rows of lengths n_i and S = max n_i,

        computed = B * S,   padded_frac = 1 - sum(n_i) / computed,   loss_frac = loss_tokens / computed

    (loss tokens: the response tokens whose log-probs enter the loss; the prompts are computed as context)."""
    computed = len(lengths) * max(lengths)
    return {"length/padded_frac": 1.0 - sum(lengths) / computed, "length/loss_frac": loss_tokens / computed}


def step_metrics(groups: list[list[Sample]], texts: list[str], rewards: list[float], reward_stats: dict,
                 mask_BT: torch.Tensor, logp_old_BT: torch.Tensor, logp_sampler_BT: torch.Tensor,
                 loss_metrics: dict[str, float], times: dict[str, float], sync_report: dict,
                 lost: int) -> dict[str, float]:
    """Every metric of a step. ``times``: the phases' seconds (rollout, reward, logp, update, sync); ``lost``:
    the prompts x G samples that no server answered."""
    samples = [s for g in groups for s in g]
    lengths = mask_BT.sum(-1)
    n_tokens = float(mask_BT.sum())
    m: dict[str, float] = {f"loss/{k}": v for k, v in loss_metrics.items()}
    m.update({f"mismatch/{k}": scalar(v) for k, v in mismatch_metrics(logp_old_BT, logp_sampler_BT,
                                                                        mask_BT).items()})
    stats = error_token_stats([s.response_ids for s in samples], [s.logp_sampler for s in samples],
                              finish_reasons=[s.finish_reason for s in samples], texts=texts)
    m.update({f"error_tokens/{k}": v for k, v in error_token_metrics(stats, rewards).items()})
    m["reward/mean"] = sum(rewards) / len(rewards)
    m["reward/accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
    m["reward/timeouts"] = float(reward_stats.get("timeouts", 0))
    m["length/response_mean"] = float(lengths.mean())
    m["length/response_max"] = float(lengths.max())
    m["length/truncated_frac"] = sum(s.finish_reason == "length" for s in samples) / len(lengths)
    m.update(padding_metrics([len(s.prompt_ids) + len(s.response_ids) for s in samples], n_tokens))
    for phase, seconds in times.items():
        m[f"time/{phase}_s"] = seconds
    total = sum(times.values())
    m["time/step_s"] = total
    m["throughput/rollout_tokens_per_s"] = n_tokens / max(times["rollout"], 1e-9)
    m["throughput/tokens_per_s"] = n_tokens / max(total, 1e-9)
    m["sync/bytes"] = float(sync_report["bytes"])
    m["sync/seconds"] = float(sync_report["seconds"])
    m["sync/check_s"] = float(sync_report.get("check_s", 0.0))
    m["faults/prompts_lost"] = float(lost)
    return m
