"""Error-token statistics (repeated n-gram runs, sampler-improbable tokens, truncation, pos/neg rates), and
synthetic error-token bursts: TBPO drops the whole response, token PPO lets part of its gradient through."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_qarl.algo.error_tokens import (
    error_token_metrics,
    error_token_stats,
    has_boxed_answer,
    longest_repeat_run,
)
from megatron_qarl.algo.policy_loss import PolicyLossConfig, policy_loss

D = torch.float64
TOKEN = PolicyLossConfig(mode="token_ppo", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)  # DAPO clip-higher


def brute_force_repeat_run(ids: list[int], max_ngram: int) -> int:
    """Longest segment with a period n <= max_ngram and length >= 2n, by enumeration."""
    best = 0
    for start in range(len(ids)):
        for end in range(start + 2, len(ids) + 1):
            seg = ids[start:end]
            for n in range(1, min(max_ngram, len(seg) // 2) + 1):
                if all(seg[k] == seg[k - n] for k in range(n, len(seg))):
                    best = max(best, len(seg))
                    break
    return best


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([], 0),
        ([7], 0),
        ([1, 2, 3, 4], 0),
        ([3, 3], 2),
        ([1, 2, 1], 0),  # one and a half copies of (1, 2) is not a repeat
        ([1, 2, 1, 2, 1, 2], 6),
        ([1, 2, 1, 2, 1], 5),  # (1 2)(1 2) plus a partial third copy stays periodic
        ([5, 1, 2, 3, 1, 2, 3, 9], 6),
        ([9, 9, 9, 9, 0, 4, 5, 4, 5], 4),
    ],
)
def test_longest_repeat_run_hand_cases(ids: list[int], expected: int) -> None:
    assert longest_repeat_run(ids) == expected
    assert longest_repeat_run(torch.tensor(ids, dtype=torch.long)) == expected


def test_max_ngram_limits_the_period() -> None:
    ids = [1, 2, 3, 4, 1, 2, 3, 4]
    assert longest_repeat_run(ids, max_ngram=4) == 8
    assert longest_repeat_run(ids, max_ngram=3) == 0


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 3), max_size=14), max_ngram=st.integers(1, 7))
def test_repeat_run_matches_brute_force(ids: list[int], max_ngram: int) -> None:
    assert longest_repeat_run(ids, max_ngram) == brute_force_repeat_run(ids, max_ngram)


@settings(max_examples=50, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 50), max_size=10),
    gram=st.lists(st.integers(0, 50), min_size=1, max_size=5),
    copies=st.integers(2, 6),
)
def test_inserted_repetition_is_found(prefix: list[int], gram: list[int], copies: int) -> None:
    assert longest_repeat_run(prefix + gram * copies + prefix) >= len(gram) * copies


def test_has_boxed_answer() -> None:
    assert has_boxed_answer("so the sum is \\boxed{936}.")
    assert has_boxed_answer("\\boxed{\\frac{1}{2}}")
    assert not has_boxed_answer("the answer is \\boxed{93")
    assert not has_boxed_answer("no answer at all")


def test_stats_from_ragged_lists_hand_computed() -> None:
    low, high = math.log(1e-4), math.log(0.5)  # sampler probabilities 1e-4 (< 1e-3) and 0.5
    stats = error_token_stats(
        [[1, 2, 1, 2, 1, 2], [4, 5, 6, 7], [8, 8, 8]],
        [[high, low, low, high, high, high], [high] * 4, [low, high, high]],
        finish_reasons=["length", "stop", "length"],
        texts=["1212", "\\boxed{7}", "\\boxed{8}"],
    )
    assert stats.length_B.tolist() == [6, 4, 3]
    assert stats.repeat_run_B.tolist() == [6, 0, 3]
    assert stats.low_prob_frac_B.tolist() == pytest.approx([2 / 6, 0.0, 1 / 3], abs=1e-12)
    assert stats.truncated_no_answer_B.tolist() == [True, False, False]  # the third has an answer


def test_padded_tensors_give_the_same_stats_as_lists() -> None:
    ids = [[1, 2, 1, 2], [3, 4, 5]]
    logps = [[-0.1, -9.0, -0.2, -0.3], [-8.0, -0.1, -0.2]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    ids_BT = torch.tensor([[1, 2, 1, 2], [3, 4, 5, 5]])  # the pad repeats a token: must not count
    logp_BT = torch.tensor([[-0.1, -9.0, -0.2, -0.3], [-8.0, -0.1, -0.2, -99.0]])
    from_lists = error_token_stats(ids, logps, finish_reasons=["stop", "length"], has_answer=[True, False])
    from_tensors = error_token_stats(
        ids_BT, logp_BT, mask_BT=mask, finish_reasons=["stop", "length"], has_answer=[True, False]
    )
    for name in ("length_B", "repeat_run_B", "low_prob_frac_B", "truncated_no_answer_B"):
        assert torch.equal(getattr(from_lists, name), getattr(from_tensors, name)), name
    assert from_tensors.repeat_run_B.tolist() == [4, 0]
    assert from_tensors.truncated_no_answer_B.tolist() == [False, True]


def test_without_finish_reasons_nothing_counts_as_truncated() -> None:
    stats = error_token_stats([[1, 2]], [[-0.1, -0.1]], texts=["no answer"])
    assert stats.truncated_no_answer_B.tolist() == [False]


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="2 tokens but 1 sampler logprobs"):
        error_token_stats([[1, 2]], [[-0.1]])
    with pytest.raises(ValueError, match="finish_reasons has 2 entries for 1 responses"):
        error_token_stats([[1]], [[-0.1]], finish_reasons=["stop", "stop"])
    stats = error_token_stats([[1]], [[-0.1]])
    with pytest.raises(ValueError, match="2 scores for 1 responses"):
        error_token_metrics(stats, [1.0, 0.0])


def test_metrics_split_positive_and_negative_hand_computed() -> None:
    low, high = math.log(1e-5), math.log(0.9)
    repetitive = [1, 2] * 40  # an 80-token run
    stats = error_token_stats(
        [[5, 6, 7, 8], repetitive, [9, 10], [3, 3, 4, 5]],
        [[high] * 4, [low] * 80, [low, high], [high] * 4],
        finish_reasons=["stop", "length", "stop", "length"],
        has_answer=[True, False, False, True],
    )
    rewards = [1.0, 0.0, 0.0, 1.0]  # responses 0 and 3 are positive
    m = error_token_metrics(stats, rewards, repeat_min_tokens=64)
    assert (m["err_num_pos"], m["err_num_neg"]) == (2.0, 2.0)
    assert m["err_repeat_run_max"] == 80.0
    assert m["err_repeat_run_mean_pos"] == pytest.approx((0 + 2) / 2)
    assert m["err_repeat_run_mean_neg"] == pytest.approx((80 + 0) / 2)
    assert m["err_repeat_run_mean"] == pytest.approx(82 / 4)
    assert (m["err_repeat_rate"], m["err_repeat_rate_pos"], m["err_repeat_rate_neg"]) == (0.25, 0.0, 0.5)
    assert m["err_low_prob_frac_neg"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["err_low_prob_frac_pos"] == 0.0
    assert (m["err_low_prob_resp_rate_pos"], m["err_low_prob_resp_rate_neg"]) == (0.0, 1.0)
    assert (m["err_truncated_no_answer_rate_pos"], m["err_truncated_no_answer_rate_neg"]) == (0.0, 0.5)
    assert m["err_truncated_no_answer_rate"] == 0.25


def test_metrics_with_advantages_and_an_empty_group() -> None:
    stats = error_token_stats([[1, 1], [2, 3]], [[-0.1, -0.1], [-0.1, -0.1]])
    m = error_token_metrics(stats, torch.tensor([0.5, 1.5]))  # all positive: the negative group is empty
    assert m["err_num_neg"] == 0.0 and m["err_repeat_run_mean_neg"] == 0.0
    assert m["err_repeat_run_mean_pos"] == 1.0
    m = error_token_metrics(stats, torch.tensor([0.5, 1.5]), threshold=1.0)
    assert m["err_repeat_run_mean_neg"] == 2.0 and m["err_repeat_run_mean_pos"] == 0.0


def loss_and_grad(batch, cfg: PolicyLossConfig):
    loss, metrics = policy_loss(*batch, cfg)
    (grad,) = torch.autograd.grad(loss, batch[0], allow_unused=True)
    return loss.detach(), (torch.zeros_like(batch[0]) if grad is None else grad), metrics


# ---------------------------------------------------------------- error-token bursts
def burst_batch(kind: str):
    """Response 0: 10 tokens, tokens 4-6 a burst at probability 1e-6, A = -1. Response 1: clean, A = +1."""
    old = torch.full((2, 10), -0.5, dtype=D)
    old[0, 4:7] = math.log(1e-6)
    logp, sampler = old.clone(), old.clone()
    if kind == "ratio":  # the update moved the burst tokens to 1e-4: token ratio 100 (paper, Fig. 5)
        logp[0, 4:7] = math.log(1e-4)
    else:  # the sampler gave the burst 1e-2 where the aligned learner gives 1e-6: mismatch weight 1e-4
        sampler[0, 4:7] = math.log(1e-2)
    mask, adv = torch.ones(2, 10, dtype=torch.bool), torch.tensor([-1.0, 1.0], dtype=D)
    return logp.requires_grad_(), old, sampler, mask, adv


def test_ratio_burst_masked_by_tbpo_but_token_ppo_lets_gradient_through() -> None:
    _, grad, m = loss_and_grad(burst_batch("ratio"), PolicyLossConfig())
    assert not grad[0].any() and grad[1].all()  # whole response dropped; the clean one still learns
    assert float(m["band_prox_masked_frac_neg"]) == 1.0
    assert float(m["seq_ratio_max"]) == pytest.approx(100**0.3)  # exp(3 * ln(100) / 10)
    _, grad, m = loss_and_grad(burst_batch("ratio"), TOKEN)
    # the dual clip holds the burst tokens only: the other 7 tokens of the response still get gradient
    assert not grad[0, 4:7].any() and grad[0, :4].all() and grad[0, 7:].all()
    assert float(m["dual_clip_frac"]) == pytest.approx(3 / 20)
    _, grad, _ = loss_and_grad(burst_batch("ratio"), TOKEN.model_copy(update={"dual_clip_c": None}))
    assert torch.allclose(grad[0, 4:7], 100 * grad[0, 0].expand(3))  # without it the burst dominates


def test_mismatch_burst_masked_by_tbpo_but_token_ppo_lets_gradient_through() -> None:
    _, grad, m = loss_and_grad(burst_batch("mismatch"), PolicyLossConfig())
    assert not grad[0].any() and grad[1].all()
    assert float(m["band_mis_masked_frac_neg"]) == 1.0 and float(m["mismatch_tok_abs_p99"]) > 9.0
    _, grad, _ = loss_and_grad(burst_batch("mismatch"), TOKEN)
    assert grad[0].all()  # every token of the burst response, burst included, is pushed
