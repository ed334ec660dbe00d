"""GRPO group advantages: one scalar per response, computed from the rewards of its prompt's group.

Shape suffixes: B responses, P prompts, G responses per prompt (B = P * G). Responses of one prompt are
contiguous: rows ``p*G .. p*G + G - 1`` of ``rewards_B`` belong to prompt p (the order the rollout returns).

Estimators (r_i the reward of response i, mean and std over its group of G):

- ``grpo``:           A_i = (r_i - mean(r)) / (std(r) + eps)
- ``grpo_mean_only``: A_i = r_i - mean(r)                        (Dr. GRPO: no std normalisation)
- ``leave_one_out``:  A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r))   (RLOO baseline)

A group whose rewards are all equal gets A = 0 under every estimator; a group of one response too.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

AdvantageEstimator = Literal["grpo", "grpo_mean_only", "leave_one_out"]


class AdvantageConfig(BaseModel):
    """How per-response advantages are computed from group rewards (``algo.advantage`` in the run config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: AdvantageEstimator = Field("grpo", description="grpo | grpo_mean_only | leave_one_out")
    eps: float = Field(1e-6, ge=0.0, description="added to the group std (grpo) so equal rewards give A = 0")
    unbiased_std: bool = Field(True, description="grpo std with Bessel's correction (G-1), as torch.std")


def group_advantages(
    rewards_B: Tensor | list[float], group_size: int, cfg: AdvantageConfig | None = None
) -> Tensor:
    """Per-response advantages A_B from rewards of P contiguous groups of ``group_size`` responses.

    Formulas in the module docstring. Integer rewards are promoted to float32; float64 stays float64.
    Raises ValueError when the number of rewards is not a multiple of ``group_size``.
    """
    cfg = cfg or AdvantageConfig()
    rewards_B = torch.as_tensor(rewards_B)
    if not rewards_B.is_floating_point():
        rewards_B = rewards_B.to(torch.float32)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards_B.dim() != 1 or rewards_B.numel() % group_size != 0:
        shape = tuple(rewards_B.shape)
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {shape}"
        )
    r_PG = rewards_B.reshape(-1, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards_B)
    mean_P1 = r_PG.mean(-1, keepdim=True)
    if cfg.estimator == "grpo":
        std_P1 = r_PG.std(-1, keepdim=True, correction=1 if cfg.unbiased_std else 0)
        adv_PG = (r_PG - mean_P1) / (std_P1 + cfg.eps)
    elif cfg.estimator == "grpo_mean_only":
        adv_PG = r_PG - mean_P1
    else:  # leave_one_out
        loo_mean_PG = (r_PG.sum(-1, keepdim=True) - r_PG) / (group_size - 1)
        adv_PG = r_PG - loo_mean_PG
    # exactly 0 for a group of equal rewards (floating-point means need not reproduce the common value)
    constant_P1 = r_PG.amax(-1, keepdim=True) == r_PG.amin(-1, keepdim=True)
    return torch.where(constant_P1, torch.zeros_like(adv_PG), adv_PG).reshape(-1)
