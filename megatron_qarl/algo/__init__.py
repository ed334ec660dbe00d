"""RL math: GRPO advantages, policy losses (token PPO, GSPO, TBPO), mismatch and error-token metrics.

Pure torch (no Megatron), so another trainer can import it. Formulas and metric names: docs/algorithm.md.
"""

from megatron_qarl.algo.advantages import AdvantageConfig, group_advantages
from megatron_qarl.algo.error_tokens import (
    ErrorTokenStats,
    error_token_metrics,
    error_token_stats,
    longest_repeat_run,
)
from megatron_qarl.algo.mismatch import mismatch_metrics, ratio_metrics
from megatron_qarl.algo.policy_loss import (
    PolicyLossConfig,
    PolicyObjective,
    aggregate_loss,
    clipped_objective,
    loss_normalizer,
    policy_loss,
    policy_objective,
)

__all__ = [
    "AdvantageConfig",
    "ErrorTokenStats",
    "PolicyLossConfig",
    "PolicyObjective",
    "aggregate_loss",
    "clipped_objective",
    "error_token_metrics",
    "error_token_stats",
    "group_advantages",
    "longest_repeat_run",
    "loss_normalizer",
    "mismatch_metrics",
    "policy_loss",
    "policy_objective",
    "ratio_metrics",
]
