"""Policy losses over [B, T] tensors: token PPO (GRPO, clip-higher, dual clip), GSPO and TBPO.

Shape suffixes: B responses, T token positions (right-padded; ``mask_BT`` marks response tokens).
Formulas, defaults and metric names are in docs/algorithm.md; this module depends on torch and pydantic
only, so any trainer can call :func:`policy_loss`.

Inputs per token: ``logp`` (learner, with grad), ``logp_old`` (learner's aligned forward at the synced
weights), ``logp_sampler`` (rollout engine); per response: the advantage ``adv_B``. ``logp_old`` and
``logp_sampler`` are treated as data (stop-gradient).

    r_prox[i,t] = exp(logp - logp_old)                 w_mis[i,t] = exp(logp_old - logp_sampler)
    s_prox[i]   = exp(mean_t (logp - logp_old))        s_mis[i]   = exp(mean_t (logp_old - logp_sampler))
    clipobj(x, A) = min(x A, clip(x, 1 - eps_low, 1 + eps_high) A), and for A < 0 with dual clip c:
                    max(min(...), c A)

Modes (objective maximised; the loss is its negative, aggregated as below):
    token_ppo  obj[i,t] = m[i,t] * clipobj(r_prox[i,t], A_i)
    gspo       J_i      = m_i * clipobj(s_prox_i, A_i)
    tbpo       J_i      = band_i * sg(s_mis_i) * clipobj(s_prox_i, A_i)
               band_i   = [w_low <= s_mis_i <= w_high] * [1 - delta_low <= s_prox_i <= 1 + delta_high]
where m is the mismatch correction (sg = stop-gradient; ``mismatch`` field; token_ppo takes all four,
gspo the sequence ones, tbpo none because its band and weight are that correction):
    none 1;  tis_token sg(min(w_mis, C));  mis_token sg(w_mis) [w_low <= w_mis <= w_high];
    tis_seq sg(min(s_mis, C));  mis_seq sg(s_mis) [w_low <= s_mis <= w_high].
A sequence mode spreads J_i over the response's tokens, obj[i,t] = J_i, so one aggregation serves all modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from torch import Tensor

from megatron_qarl.algo.mismatch import (
    DEFAULT_LOG_RATIO_CLAMP,
    as_bool_mask,
    fraction,
    mismatch_metrics,
    ratio_metrics,
    sequence_log_ratio_B,
    sequence_mean_B,
    token_log_ratio_BT,
)

PolicyLossMode = Literal["token_ppo", "gspo", "tbpo"]
MismatchCorrection = Literal["none", "tis_token", "mis_token", "tis_seq", "mis_seq"]
LossAggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"]

_TOKEN_CORRECTIONS = ("tis_token", "mis_token")


class PolicyLossConfig(BaseModel):
    """The policy loss (``algo.loss`` in the run config). Defaults are TBPO's (docs/algorithm.md, "Defaults and
    why")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: PolicyLossMode = Field("tbpo", description="token_ppo | gspo | tbpo")
    eps_low: float = Field(3e-4, description="lower clip: ratio clipped at 1 - eps_low (A < 0 side)")
    eps_high: float = Field(4e-4, description="upper clip: ratio clipped at 1 + eps_high (A > 0 side)")
    dual_clip_c: float | None = Field(3.0, description="dual clip for A < 0: objective >= c*A; None disables")
    mismatch: MismatchCorrection = Field("none", description="learner-sampler correction (not for tbpo)")
    tis_cap: float = Field(2.0, description="C of truncated importance sampling: weight min(w, C)")
    w_low: float = Field(0.5, description="lower edge of the mismatch band (MIS and TBPO)")
    w_high: float = Field(2.0, description="upper edge of the mismatch band (MIS and TBPO)")
    delta_low: float = Field(0.2, description="TBPO ratio band lower edge 1 - delta_low")
    delta_high: float = Field(0.2, description="TBPO ratio band upper edge 1 + delta_high")
    aggregation: LossAggregation = Field("seq_mean_token_mean", description="how token terms become one loss")
    norm_len: int | None = Field(None, description="constant length for aggregation seq_mean_token_sum")
    log_ratio_clamp: float = Field(DEFAULT_LOG_RATIO_CLAMP, description="|log ratio| clamp before exp")

    @field_validator("eps_low", "delta_low")
    @classmethod
    def _in_unit_interval(cls, value: float, info: ValidationInfo) -> float:
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{info.field_name} must be in [0, 1), got {value}")
        return value

    @field_validator("eps_high", "delta_high")
    @classmethod
    def _non_negative(cls, value: float, info: ValidationInfo) -> float:
        if value < 0.0:
            raise ValueError(f"{info.field_name} must be >= 0, got {value}")
        return value

    @field_validator("tis_cap", "w_low", "log_ratio_clamp")
    @classmethod
    def _positive(cls, value: float, info: ValidationInfo) -> float:
        if not value > 0.0:
            raise ValueError(f"{info.field_name} must be > 0, got {value}")
        return value

    @field_validator("dual_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        if value is not None and not value > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (None disables dual clip), got {value}")
        return value

    @model_validator(mode="after")
    def _check_combination(self) -> PolicyLossConfig:
        if not self.w_low < self.w_high:
            raise ValueError(f"w_low ({self.w_low}) must be < w_high ({self.w_high})")
        if self.mode == "tbpo" and self.mismatch != "none":
            raise ValueError(
                f"mismatch={self.mismatch!r} with mode='tbpo': TBPO applies its own sequence mismatch weight "
                "and band (w_low, w_high); set mismatch to 'none'"
            )
        if self.mode == "gspo" and self.mismatch in _TOKEN_CORRECTIONS:
            raise ValueError(
                f"mismatch={self.mismatch!r} is token-level; mode 'gspo' takes tis_seq or mis_seq"
            )
        if self.aggregation == "seq_mean_token_sum" and (self.norm_len is None or self.norm_len < 1):
            raise ValueError(f"aggregation 'seq_mean_token_sum' needs norm_len >= 1, got {self.norm_len}")
        return self


def clipped_objective(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> Tensor:
    """PPO clip with optional dual clip, elementwise (shapes broadcast).

    obj = min(x A, clip(x, 1 - eps_low, 1 + eps_high) A);  if A < 0 and c is set: obj = max(obj, c A).
    """
    obj = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    if dual_clip_c is not None:
        obj = torch.where(adv < 0, torch.maximum(obj, dual_clip_c * adv), obj)
    return obj


@dataclass(frozen=True)
class PolicyObjective:
    """Everything one evaluation of the objective produces. ``obj_BT`` carries grad (its per-response mean,
    ``sequence_mean_B(obj_BT, mask)``, is J_i in the sequence modes).

    Units are tokens ([B, T] flags) in token_ppo and responses ([B] flags) in gspo / tbpo.
    """

    obj_BT: Tensor  # objective per token (maximised), 0 on padding and on masked tokens / responses
    unit_valid_U: Tensor  # units taking part in the statistics (response tokens, or non-empty responses)
    clip_high_U: Tensor  # A > 0 and ratio > 1 + eps_high
    clip_low_U: Tensor  # A < 0 and ratio < 1 - eps_low
    dual_clip_U: Tensor  # A < 0 and ratio > c (dual clip holds the objective at c A)
    tis_truncated_U: Tensor  # TIS weight capped at C (units of the correction: tokens or responses)
    mis_masked_U: Tensor  # dropped by the MIS mask (units of the correction)
    corr_valid_U: Tensor  # the units of the correction
    in_mis_band_B: Tensor  # w_low <= s_mis_i <= w_high
    in_prox_band_B: Tensor  # 1 - delta_low <= s_prox_i <= 1 + delta_high


def _mismatch_weight(
    cfg: PolicyLossConfig, w_U: Tensor
) -> tuple[Tensor | float, Tensor | None, Tensor, Tensor]:
    """(weight, keep mask or None, truncated flags, masked flags) of the correction for weights w_U."""
    none = torch.zeros_like(w_U, dtype=torch.bool)
    if cfg.mismatch.startswith("tis"):
        return w_U.clamp(max=cfg.tis_cap), None, w_U > cfg.tis_cap, none
    if cfg.mismatch.startswith("mis"):
        keep_U = (w_U >= cfg.w_low) & (w_U <= cfg.w_high)
        return torch.where(keep_U, w_U, torch.zeros_like(w_U)), keep_U, none, ~keep_U
    return 1.0, None, none, none


def policy_objective(
    logp_BT: Tensor,
    logp_old_BT: Tensor,
    logp_sampler_BT: Tensor,
    mask_BT: Tensor,
    adv_B: Tensor,
    cfg: PolicyLossConfig | None = None,
) -> PolicyObjective:
    """The per-token and per-response objective of ``cfg.mode`` (formulas in the module docstring).

    Inputs in half precision are computed in float32; float64 stays float64.
    """
    cfg = cfg or PolicyLossConfig()
    if not (logp_BT.shape == logp_old_BT.shape == logp_sampler_BT.shape == mask_BT.shape):
        raise ValueError(
            f"logp {tuple(logp_BT.shape)}, logp_old {tuple(logp_old_BT.shape)}, logp_sampler "
            f"{tuple(logp_sampler_BT.shape)} and mask {tuple(mask_BT.shape)} must share one [B, T] shape"
        )
    if logp_BT.dim() != 2 or adv_B.shape != logp_BT.shape[:1]:
        raise ValueError(f"adv must have shape [B]={tuple(logp_BT.shape[:1])}, got {tuple(adv_B.shape)}")
    dtype = logp_BT.dtype if logp_BT.dtype in (torch.float32, torch.float64) else torch.float32
    logp_BT = logp_BT.to(dtype)
    logp_old_BT = logp_old_BT.detach().to(dtype)
    logp_sampler_BT = logp_sampler_BT.detach().to(dtype)
    adv_B = adv_B.detach().to(dtype)
    mask_BT = as_bool_mask(mask_BT)
    nonempty_B = mask_BT.any(-1)
    clamp = cfg.log_ratio_clamp
    eps_low, eps_high, c = cfg.eps_low, cfg.eps_high, cfg.dual_clip_c

    # both bands are evaluated in every mode: TBPO applies them, the others report them as diagnostics
    with torch.no_grad():
        s_mis_B = torch.exp(sequence_log_ratio_B(logp_old_BT, logp_sampler_BT, mask_BT, clamp))
        s_prox_det_B = torch.exp(sequence_log_ratio_B(logp_BT.detach(), logp_old_BT, mask_BT, clamp))
        in_mis_band_B = (s_mis_B >= cfg.w_low) & (s_mis_B <= cfg.w_high)
        in_prox_band_B = (s_prox_det_B >= 1.0 - cfg.delta_low) & (s_prox_det_B <= 1.0 + cfg.delta_high)

    if cfg.mode == "token_ppo":
        adv_BT = adv_B[:, None].expand_as(logp_BT)
        ratio_BT = torch.exp(token_log_ratio_BT(logp_BT, logp_old_BT, mask_BT, clamp))
        obj_BT = clipped_objective(ratio_BT, adv_BT, eps_low, eps_high, c)
        if cfg.mismatch in _TOKEN_CORRECTIONS:
            w_BT = torch.exp(token_log_ratio_BT(logp_old_BT, logp_sampler_BT, mask_BT, clamp))
            weight, keep, truncated_U, masked_U = _mismatch_weight(cfg, w_BT)
            corr_valid_U = mask_BT
        else:
            weight, keep, truncated_U, masked_U = _mismatch_weight(cfg, s_mis_B)
            corr_valid_U = nonempty_B
            weight = weight[:, None] if isinstance(weight, Tensor) else weight
            keep = keep[:, None] if keep is not None else None
        live_BT = mask_BT if keep is None else mask_BT & keep
        obj_BT = torch.where(live_BT, obj_BT * weight, torch.zeros_like(obj_BT))
        ratio_U, adv_U, unit_valid_U = ratio_BT.detach(), adv_BT, mask_BT
    else:
        log_s_B = sequence_log_ratio_B(logp_BT, logp_old_BT, mask_BT, clamp)
        if cfg.mode == "tbpo":
            weight, live_B = s_mis_B, in_mis_band_B & in_prox_band_B
            truncated_U = masked_U = torch.zeros_like(live_B)
        else:
            weight, keep, truncated_U, masked_U = _mismatch_weight(cfg, s_mis_B)
            live_B = torch.ones_like(nonempty_B) if keep is None else keep
        # responses outside the band get log s = 0 before exp, so no inf/nan can reach their (zero) gradient
        s_prox_B = torch.exp(torch.where(live_B, log_s_B, torch.zeros_like(log_s_B)))
        j_B = torch.where(live_B, clipped_objective(s_prox_B, adv_B, eps_low, eps_high, c) * weight, 0.0)
        obj_BT = torch.where(mask_BT, j_B[:, None].expand_as(logp_BT), torch.zeros_like(logp_BT))
        ratio_U, adv_U, unit_valid_U, corr_valid_U = s_prox_det_B, adv_B, nonempty_B, nonempty_B

    dual_U = (adv_U < 0) & (ratio_U > c) if c is not None else torch.zeros_like(unit_valid_U)
    return PolicyObjective(
        obj_BT=obj_BT,
        unit_valid_U=unit_valid_U,
        clip_high_U=(adv_U > 0) & (ratio_U > 1.0 + eps_high),
        clip_low_U=(adv_U < 0) & (ratio_U < 1.0 - eps_low),
        dual_clip_U=dual_U,
        tis_truncated_U=truncated_U,
        mis_masked_U=masked_U,
        corr_valid_U=corr_valid_U,
        in_mis_band_B=in_mis_band_B,
        in_prox_band_B=in_prox_band_B,
    )


def loss_normalizer(mask_BT: Tensor, cfg: PolicyLossConfig | None = None) -> int:
    """The denominator :func:`aggregate_loss` uses for this batch when no normalizer is passed.

    token_mean: the number of response tokens; the other aggregations: the number of non-empty responses.
    Sum it over micro-batches (and data-parallel ranks that sum gradients) to get the global normalizer.
    """
    cfg = cfg or PolicyLossConfig()
    mask_BT = as_bool_mask(mask_BT)
    if cfg.aggregation == "token_mean":
        return int(mask_BT.sum())
    return int(mask_BT.any(-1).sum())


def aggregate_loss(
    obj_BT: Tensor, mask_BT: Tensor, cfg: PolicyLossConfig | None = None, normalizer: float | None = None
) -> Tensor:
    """Loss = -(aggregated objective), N the number of non-empty responses and L_i their lengths:

    - ``seq_mean_token_mean``: -(1/N) sum_i (1/L_i) sum_t obj[i,t]   (each response weighs the same)
    - ``token_mean``:          -(1/sum_i L_i) sum_{i,t} obj[i,t]       (each token weighs the same)
    - ``seq_mean_token_sum``:  -(1/N) sum_{i,t} obj[i,t] / norm_len     (Dr. GRPO: constant length)

    ``normalizer`` replaces the denominator (N, or sum_i L_i for token_mean). Micro-batches of one global
    batch that pass the global count (the sum of :func:`loss_normalizer` over micro-batches) give losses
    that sum to the global batch's loss, so accumulating their gradients is exact. Without it each call
    normalizes by its own count (losses 0 when the batch has no response token).
    """
    cfg = cfg or PolicyLossConfig()
    mask_BT = as_bool_mask(mask_BT)
    if cfg.aggregation == "seq_mean_token_mean":
        numerator = sequence_mean_B(obj_BT, mask_BT).sum()
    else:
        numerator = torch.where(mask_BT, obj_BT, torch.zeros_like(obj_BT)).sum()
        if cfg.aggregation == "seq_mean_token_sum":
            numerator = numerator / cfg.norm_len
    denominator = float(normalizer) if normalizer is not None else max(loss_normalizer(mask_BT, cfg), 1)
    return -numerator / denominator


def _sign_split_fractions(name: str, flags_B: Tensor, adv_B: Tensor, valid_B: Tensor) -> dict[str, Tensor]:
    """``name`` over all valid responses, and ``name_pos`` / ``name_neg`` over those with A > 0 / A < 0."""
    return {
        name: fraction(flags_B, valid_B),
        f"{name}_pos": fraction(flags_B, valid_B & (adv_B > 0)),
        f"{name}_neg": fraction(flags_B, valid_B & (adv_B < 0)),
    }


def policy_loss(
    logp_BT: Tensor,
    logp_old_BT: Tensor,
    logp_sampler_BT: Tensor,
    mask_BT: Tensor,
    adv_B: Tensor,
    cfg: PolicyLossConfig | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of ``cfg`` (default TBPO) and its metrics, for any trainer.

    Args: log-probs [B, T] of the response tokens (``logp`` with grad; ``logp_old`` and ``logp_sampler``
    used as data), ``mask_BT`` (bool or 0/1), per-response advantages ``adv_B``, and an optional
    ``normalizer`` (see :func:`aggregate_loss`: pass the global count when splitting into micro-batches).
    Returns (scalar loss to minimise, metrics): detached 0-dim float64 tensors with the keys listed in
    docs/algorithm.md. The key set is the same in every mode; band metrics in token_ppo and gspo report what
    TBPO's bands would mask. Metrics are per call: average micro-batch values on the caller's side.
    """
    cfg = cfg or PolicyLossConfig()
    out = policy_objective(logp_BT, logp_old_BT, logp_sampler_BT, mask_BT, adv_B, cfg)
    loss = aggregate_loss(out.obj_BT, mask_BT, cfg, normalizer)
    with torch.no_grad():
        mask_BT = as_bool_mask(mask_BT)
        nonempty_B = mask_BT.any(-1)
        adv_B = adv_B.detach()
        metrics: dict[str, Tensor] = {
            "loss": loss.detach().double(),
            "num_responses": nonempty_B.sum().double(),
            "num_tokens": mask_BT.sum().double(),
            "clip_frac": fraction(out.clip_high_U | out.clip_low_U, out.unit_valid_U),
            "clip_frac_high": fraction(out.clip_high_U, out.unit_valid_U),
            "clip_frac_low": fraction(out.clip_low_U, out.unit_valid_U),
            "dual_clip_frac": fraction(out.dual_clip_U, out.unit_valid_U),
            "tis_truncated_frac": fraction(out.tis_truncated_U, out.corr_valid_U),
            "mis_masked_frac": fraction(out.mis_masked_U, out.corr_valid_U),
        }
        outside_mis_B, outside_prox_B = ~out.in_mis_band_B, ~out.in_prox_band_B
        metrics.update(
            _sign_split_fractions("band_masked_frac", outside_mis_B | outside_prox_B, adv_B, nonempty_B)
        )
        metrics.update(_sign_split_fractions("band_mis_masked_frac", outside_mis_B, adv_B, nonempty_B))
        metrics.update(_sign_split_fractions("band_prox_masked_frac", outside_prox_B, adv_B, nonempty_B))
        metrics.update(ratio_metrics(logp_BT, logp_old_BT, mask_BT))
        metrics.update(mismatch_metrics(logp_old_BT, logp_sampler_BT, mask_BT))
    return loss, {key: value.detach().double() for key, value in metrics.items()}
