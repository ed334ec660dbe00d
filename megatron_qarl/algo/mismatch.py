"""Masked reductions, token and sequence ratios, and the mismatch / ratio metrics.

Shape suffixes: B responses, T token positions (right-padded, ``mask_BT`` marks the response tokens).
Every function here is pure torch and ignores whatever the padding positions hold (even inf or nan):
masked entries are replaced with ``torch.where`` before any arithmetic, so neither values nor gradients
leak from padding.

Notation (docs/algorithm.md): ``logp`` is the learner during the update, ``logp_old`` the learner's aligned
forward at the synced weights, ``logp_sampler`` what the rollout engine returned with the sample.

- token ratio            r_prox[i,t] = exp(logp - logp_old)
- token mismatch weight  w_mis[i,t]  = exp(logp_old - logp_sampler)
- sequence ratio         s_prox[i]   = exp(mean_t (logp - logp_old))          (length-normalised, GSPO)
- sequence mismatch      s_mis[i]    = exp(mean_t (logp_old - logp_sampler))  (geometric mean of w_mis)
"""

from __future__ import annotations

import torch
from torch import Tensor

# |log ratio| beyond this is clamped before exp: exp(20) ~ 4.9e8 is far outside any clip or band, and the
# clamp keeps float32 from overflowing to inf (inf * 0 in a backward pass is nan).
DEFAULT_LOG_RATIO_CLAMP = 20.0


def as_bool_mask(mask_BT: Tensor) -> Tensor:
    """The mask as a bool tensor (accepts bool, integer or float 0/1 masks)."""
    return mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0


def masked_sum_B(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """sum_t x[i,t] over the response tokens of each response; padding ignored."""
    mask_BT = as_bool_mask(mask_BT)
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum(-1)


def sequence_mean_B(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """(1/L_i) sum_t x[i,t]; an empty response (L_i = 0) gives 0."""
    lengths_B = as_bool_mask(mask_BT).sum(-1).clamp(min=1).to(x_BT.dtype)
    return masked_sum_B(x_BT, mask_BT) / lengths_B


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of x over all response tokens of the batch (0-dim); 0 when there are none."""
    mask_BT = as_bool_mask(mask_BT)
    total = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum()
    return total / mask_BT.sum().clamp(min=1).to(x_BT.dtype)


def token_log_ratio_BT(
    logp_a_BT: Tensor, logp_b_BT: Tensor, mask_BT: Tensor, clamp: float | None = DEFAULT_LOG_RATIO_CLAMP
) -> Tensor:
    """log(pi_a / pi_b) per token = logp_a - logp_b, 0 on padding, clamped to [-clamp, clamp] if given."""
    mask_BT = as_bool_mask(mask_BT)
    diff_BT = torch.where(mask_BT, logp_a_BT - logp_b_BT, torch.zeros_like(logp_a_BT))
    return diff_BT if clamp is None else diff_BT.clamp(-clamp, clamp)


def sequence_log_ratio_B(
    logp_a_BT: Tensor, logp_b_BT: Tensor, mask_BT: Tensor, clamp: float | None = DEFAULT_LOG_RATIO_CLAMP
) -> Tensor:
    """mean_t (logp_a - logp_b): the log of the length-normalised sequence ratio (0 for an empty response)."""
    return sequence_mean_B(token_log_ratio_BT(logp_a_BT, logp_b_BT, mask_BT, clamp), mask_BT)


def masked_quantile(x_BT: Tensor, mask_BT: Tensor, q: float) -> Tensor:
    """The q-quantile (linear interpolation, as torch.quantile) of x over response tokens; 0 if none.

    Sort-based, so it has no size limit (torch.quantile refuses inputs over 16M elements).
    """
    values_N = x_BT[as_bool_mask(mask_BT)]
    n = values_N.numel()
    if n == 0:
        return x_BT.new_zeros(())
    sorted_N = values_N.sort().values
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_N[lo] + (sorted_N[hi] - sorted_N[lo]) * frac


def fraction(flags_U: Tensor, valid_U: Tensor) -> Tensor:
    """Share of the valid units (tokens or responses) with the flag set (0-dim float64); 0 if none valid."""
    valid_U = valid_U.bool()
    return (flags_U.bool() & valid_U).sum().double() / valid_U.sum().clamp(min=1).double()


def mismatch_metrics(logp_old_BT: Tensor, logp_sampler_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """Learner-sampler mismatch statistics of a batch (all detached 0-dim tensors).

    With d[i,t] = logp_old - logp_sampler and tokens sampled from the sampler:

    - ``mismatch_tok_abs_mean``: mean_{i,t} |d|
    - ``mismatch_tok_abs_p99``: 99th percentile of |d| over tokens
    - ``mismatch_tok_kl``: per-token KL(sampler || learner) estimate, k3 = mean_{i,t} (e^d - 1 - d) >= 0
    - ``mismatch_seq_kl``: sequence KL(sampler || learner) estimate, k1 = mean_i sum_t (-d)
    - ``mismatch_seq_weight_mean`` / ``_min`` / ``_max``: s_mis[i] = exp(mean_t d) over non-empty responses
    - ``mismatch_tok_differing``: how many response tokens' log-probs differ in any bit (``differing_tokens``;
      0 at every step under ``numerics: exact``)
    """
    with torch.no_grad():
        mask_BT = as_bool_mask(mask_BT)
        d_BT = token_log_ratio_BT(
            logp_old_BT.detach(), logp_sampler_BT.detach(), mask_BT, clamp=None
        ).double()
        nonempty_B = mask_BT.any(-1)
        k3_BT = torch.expm1(d_BT) - d_BT
        seq_k1_B = -masked_sum_B(d_BT, mask_BT)
        s_mis_B = torch.exp(sequence_mean_B(d_BT, mask_BT))[nonempty_B]
        n_resp = nonempty_B.sum().clamp(min=1).double()
        has_resp = bool(nonempty_B.any())
        return {
            "mismatch_tok_abs_mean": masked_mean(d_BT.abs(), mask_BT),
            "mismatch_tok_abs_p99": masked_quantile(d_BT.abs(), mask_BT, 0.99),
            "mismatch_tok_kl": masked_mean(k3_BT, mask_BT),
            "mismatch_seq_kl": torch.where(nonempty_B, seq_k1_B, torch.zeros_like(seq_k1_B)).sum() / n_resp,
            "mismatch_seq_weight_mean": s_mis_B.sum() / n_resp,
            "mismatch_seq_weight_min": s_mis_B.min() if has_resp else d_BT.new_ones(()),
            "mismatch_seq_weight_max": s_mis_B.max() if has_resp else d_BT.new_ones(()),
            "mismatch_tok_differing": differing_tokens(logp_old_BT, logp_sampler_BT, mask_BT),
        }


def differing_tokens(logp_a_BT: Tensor, logp_b_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """The number of response tokens whose two log-probs differ in any bit: their float32 bit patterns compared
    (so -0.0 and 0.0 differ, and a nan differs from everything but its own bits). A 0-dim float64 tensor."""
    with torch.no_grad():
        a = logp_a_BT.detach().float().contiguous().view(torch.int32)
        b = logp_b_BT.detach().float().contiguous().view(torch.int32)
        return ((a != b) & as_bool_mask(mask_BT)).sum().double()


def ratio_metrics(logp_BT: Tensor, logp_old_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """Statistics of the token ratio r_prox and the sequence ratio s_prox (detached 0-dim tensors).

    Keys: ``ratio_mean``, ``ratio_min``, ``ratio_max`` over response tokens; ``seq_ratio_mean``,
    ``seq_ratio_min``, ``seq_ratio_max`` over non-empty responses. Ratios use the unclamped log ratio.
    """
    with torch.no_grad():
        mask_BT = as_bool_mask(mask_BT)
        log_r_BT = token_log_ratio_BT(logp_BT.detach(), logp_old_BT.detach(), mask_BT, clamp=None).double()
        r_N = torch.exp(log_r_BT[mask_BT])
        s_B = torch.exp(sequence_mean_B(log_r_BT, mask_BT))[mask_BT.any(-1)]
        one = log_r_BT.new_ones(())
        return {
            "ratio_mean": r_N.mean() if r_N.numel() else one,
            "ratio_min": r_N.min() if r_N.numel() else one,
            "ratio_max": r_N.max() if r_N.numel() else one,
            "seq_ratio_mean": s_B.mean() if s_B.numel() else one,
            "seq_ratio_min": s_B.min() if s_B.numel() else one,
            "seq_ratio_max": s_B.max() if s_B.numel() else one,
        }
