"""GRPO group advantages: hand-computed values, edge cases, config validation and group properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from megatron_qarl.algo.advantages import AdvantageConfig, group_advantages

D = torch.float64


def test_grpo_hand_computed_unbiased_std() -> None:
    # group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=D), 4, AdvantageConfig(eps=0.0))
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-12)


def test_grpo_hand_computed_population_std_and_eps() -> None:
    cfg = AdvantageConfig(unbiased_std=False, eps=1e-6)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=D), 4, cfg)
    std = math.sqrt(0.75 / 4)
    assert adv.tolist() == pytest.approx([0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3, abs=1e-12)


def test_grpo_two_groups_of_two() -> None:
    # the worked example of docs/algorithm.md: A = +-0.5 / (sqrt(0.5) + 1e-6)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D), 2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, a, -a], abs=1e-12)
    assert a == pytest.approx(0.70710578, abs=1e-8)


def test_mean_only_and_leave_one_out_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0], dtype=D)
    mean_only = group_advantages(rewards, 4, AdvantageConfig(estimator="grpo_mean_only"))
    assert mean_only.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -3.0, -1.0, 1.0, 3.0], abs=1e-12)
    loo = group_advantages(rewards, 4, AdvantageConfig(estimator="leave_one_out"))
    # r_i - mean of the other three
    expected = [1.0, -1 / 3, -1 / 3, -1 / 3, 2 - 6, 4 - 16 / 3, 6 - 14 / 3, 8 - 4]
    assert loo.tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_mean_only", "leave_one_out"])
def test_equal_rewards_and_singleton_groups_give_zero(estimator: str) -> None:
    cfg = AdvantageConfig(estimator=estimator, eps=0.0)
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7]), 3, cfg)
    assert torch.equal(adv, torch.zeros(6))
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0]), 1, cfg), torch.zeros(2))


def test_integer_rewards_promoted_and_lists_accepted() -> None:
    adv = group_advantages([1, 0], 2)
    assert adv.dtype == torch.float32
    assert adv[0] > 0 > adv[1]


def test_bad_shapes_and_config_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_advantages(torch.zeros(6), 0)
    with pytest.raises(ValidationError):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValidationError):
        AdvantageConfig(eps=-1.0)
    with pytest.raises(ValidationError, match="extra"):
        AdvantageConfig(epsilon=1e-6)


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=24),
    group_size=st.integers(2, 6),
    seed=st.integers(0, 2**16),
)
def test_group_properties(rewards: list[float], group_size: int, seed: int) -> None:
    n = len(rewards) // group_size * group_size
    if n == 0:
        return
    r_B = torch.tensor(rewards[:n], dtype=D)
    grpo = group_advantages(r_B, group_size)
    mean_only = group_advantages(r_B, group_size, AdvantageConfig(estimator="grpo_mean_only"))
    loo = group_advantages(r_B, group_size, AdvantageConfig(estimator="leave_one_out"))
    for adv in (grpo, mean_only, loo):  # centred per group
        assert torch.allclose(
            adv.reshape(-1, group_size).sum(-1), torch.zeros(n // group_size, dtype=D), atol=1e-9
        )
    assert torch.allclose(loo, mean_only * group_size / (group_size - 1), atol=1e-9)
    # permuting the responses inside each group permutes their advantages
    perm = torch.randperm(group_size, generator=torch.Generator().manual_seed(seed))
    shuffled = r_B.reshape(-1, group_size)[:, perm].reshape(-1)
    expected = grpo.reshape(-1, group_size)[:, perm].reshape(-1)
    assert torch.allclose(group_advantages(shuffled, group_size), expected, atol=1e-9)
