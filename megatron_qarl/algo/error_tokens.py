"""Error-token statistics of rollout responses: repetition, sampler-improbable tokens, truncation.

Quantized decoding produces error tokens: garbled or repetitive runs that the policy gives very low
probability. Per response we measure

- ``repeat_run``: the longest periodic stretch (period n <= max_ngram) holding at least two full
  back-to-back copies of its n-gram, in tokens ("a b a b a b" -> 6, "a b a b a" -> 5, "x y x" -> 0);
- ``low_prob_frac``: the fraction of its tokens the sampler gave probability < ``low_prob`` (1e-3), i.e.
  logp_sampler < log(low_prob);
- ``truncated_no_answer``: it stopped at the length limit (finish reason "length") without a
  ``\\boxed{...}`` answer.

:func:`error_token_metrics` turns these into rates, overall and for positive and negative samples apart
(the paper finds error tokens mostly in negative samples). Shape suffixes: B responses, T token positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from megatron_qarl.data.math_task import extract_boxed

DEFAULT_MAX_NGRAM = 32
DEFAULT_LOW_PROB = 1e-3
DEFAULT_REPEAT_MIN_TOKENS = 64


def _longest_true_run(flags: np.ndarray) -> int:
    """Length of the longest run of consecutive True values."""
    if not flags.any():
        return 0
    edges = np.diff(np.concatenate(([0], flags.astype(np.int8), [0])))
    return int((np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).max())


def longest_repeat_run(
    token_ids: Sequence[int] | Tensor | np.ndarray, max_ngram: int = DEFAULT_MAX_NGRAM
) -> int:
    """Tokens in the longest periodic stretch (period n in 1..max_ngram) holding >= 2 full n-gram copies.

    For period n, positions j with ids[j] == ids[j - n] mark a periodic stretch; k consecutive such positions
    cover k + n tokens, which hold at least two copies when k >= n. Returns max over n of k + n (0 if none).
    """
    ids = np.asarray(token_ids.tolist() if isinstance(token_ids, Tensor) else token_ids, dtype=np.int64)
    best = 0
    for n in range(1, min(max_ngram, len(ids) // 2) + 1):
        k = _longest_true_run(ids[n:] == ids[:-n])
        if k >= n:
            best = max(best, k + n)
    return best


def has_boxed_answer(text: str) -> bool:
    """True when ``text`` holds a closed ``\\boxed{...}`` (balanced braces)."""
    return extract_boxed(text) is not None


@dataclass(frozen=True)
class ErrorTokenStats:
    """Per-response error-token statistics (CPU tensors of shape [B])."""

    length_B: Tensor  # response tokens
    repeat_run_B: Tensor  # longest repeated n-gram run, in tokens
    low_prob_frac_B: Tensor  # fraction of tokens with sampler probability < low_prob
    truncated_no_answer_B: Tensor  # hit the length limit without a boxed answer


def _rows(values: Sequence[Sequence[float]] | Tensor, mask_BT: Tensor | None) -> list[Tensor]:
    """Ragged rows as 1-D CPU tensors: a [B, T] tensor is cut by its mask, lists are taken as they are."""
    if isinstance(values, Tensor):
        if values.dim() != 2:
            raise ValueError(f"expected a [B, T] tensor, got shape {tuple(values.shape)}")
        values = values.detach().cpu()
        if mask_BT is None:
            return list(values)
        mask_BT = mask_BT.detach().cpu().bool()
        return [row[keep] for row, keep in zip(values, mask_BT, strict=True)]
    return [torch.as_tensor(row) for row in values]


def error_token_stats(
    token_ids: Sequence[Sequence[int]] | Tensor,
    logp_sampler: Sequence[Sequence[float]] | Tensor,
    *,
    mask_BT: Tensor | None = None,
    finish_reasons: Sequence[str | None] | None = None,
    has_answer: Sequence[bool] | None = None,
    texts: Sequence[str] | None = None,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    low_prob: float = DEFAULT_LOW_PROB,
) -> ErrorTokenStats:
    """Statistics of B responses, given as ragged lists or as right-padded [B, T] tensors with ``mask_BT``.

    A response hit the length limit when its finish reason is ``"length"`` (SGLang's and OpenAI's name).
    Whether it has an answer comes from ``has_answer``, else from ``texts`` (a closed ``\\boxed{...}``);
    with neither, or without ``finish_reasons``, no response counts as truncated without an answer.
    """
    ids_rows = _rows(token_ids, mask_BT)
    logp_rows = _rows(logp_sampler, mask_BT)
    b = len(ids_rows)
    if len(logp_rows) != b:
        raise ValueError(f"{b} token rows but {len(logp_rows)} logprob rows")
    for name, seq in (("finish_reasons", finish_reasons), ("has_answer", has_answer), ("texts", texts)):
        if seq is not None and len(seq) != b:
            raise ValueError(f"{name} has {len(seq)} entries for {b} responses")
    log_threshold = math.log(low_prob)
    lengths, runs, low_fracs = [], [], []
    for ids, logp in zip(ids_rows, logp_rows, strict=True):
        if ids.numel() != logp.numel():
            raise ValueError(f"a response has {ids.numel()} tokens but {logp.numel()} sampler logprobs")
        lengths.append(ids.numel())
        runs.append(longest_repeat_run(ids, max_ngram))
        low_fracs.append(float((logp.double() < log_threshold).double().mean()) if ids.numel() else 0.0)
    if has_answer is None and texts is not None:
        has_answer = [has_boxed_answer(text) for text in texts]
    truncated = [False] * b
    if finish_reasons is not None and has_answer is not None:
        truncated = [
            reason == "length" and not ans for reason, ans in zip(finish_reasons, has_answer, strict=True)
        ]
    return ErrorTokenStats(
        length_B=torch.tensor(lengths, dtype=torch.long),
        repeat_run_B=torch.tensor(runs, dtype=torch.long),
        low_prob_frac_B=torch.tensor(low_fracs, dtype=torch.float64),
        truncated_no_answer_B=torch.tensor(truncated, dtype=torch.bool),
    )


def error_token_metrics(
    stats: ErrorTokenStats,
    scores_B: Sequence[float] | Tensor,
    *,
    threshold: float = 0.0,
    repeat_min_tokens: int = DEFAULT_REPEAT_MIN_TOKENS,
) -> dict[str, float]:
    """Error-token rates over all responses and over positive / negative samples apart.

    A response is positive when its score > ``threshold`` and negative otherwise; pass rewards (0/1
    correctness with threshold 0) or advantages. Keys, each also with a ``_pos`` and ``_neg`` suffix:

    - ``err_repeat_run_mean``: mean longest repeated n-gram run (tokens)
    - ``err_repeat_rate``: fraction of responses whose run is >= ``repeat_min_tokens``
    - ``err_low_prob_frac``: mean over responses of the fraction of sampler-improbable tokens
    - ``err_low_prob_resp_rate``: fraction of responses with at least one sampler-improbable token
    - ``err_truncated_no_answer_rate``: fraction that hit the length limit without an answer

    plus ``err_repeat_run_max``, ``err_num_pos`` and ``err_num_neg``. An empty group gives 0.0.
    """
    scores_B = torch.as_tensor(scores_B, dtype=torch.float64).detach().cpu().reshape(-1)
    if scores_B.numel() != stats.length_B.numel():
        raise ValueError(f"{scores_B.numel()} scores for {stats.length_B.numel()} responses")
    pos_B = scores_B > threshold
    run_B = stats.repeat_run_B.double()
    per_response = {
        "err_repeat_run_mean": run_B,
        "err_repeat_rate": (stats.repeat_run_B >= repeat_min_tokens).double(),
        "err_low_prob_frac": stats.low_prob_frac_B,
        "err_low_prob_resp_rate": (stats.low_prob_frac_B > 0).double(),
        "err_truncated_no_answer_rate": stats.truncated_no_answer_B.double(),
    }
    metrics: dict[str, float] = {
        "err_repeat_run_max": float(run_B.max()) if run_B.numel() else 0.0,
        "err_num_pos": float(pos_B.sum()),
        "err_num_neg": float((~pos_B).sum()),
    }
    for name, values_B in per_response.items():
        for suffix, select_B in (("", torch.ones_like(pos_B)), ("_pos", pos_B), ("_neg", ~pos_B)):
            chosen = values_B[select_B]
            metrics[f"{name}{suffix}"] = float(chosen.mean()) if chosen.numel() else 0.0
    return metrics
