"""Policy losses: hand-computed cases per mode, autograd against a direct re-statement, properties.

The error-token burst cases (TBPO masks, token PPO leaks) are in test_algo_error_tokens.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from megatron_qarl.algo.advantages import group_advantages
from megatron_qarl.algo.mismatch import sequence_mean_B
from megatron_qarl.algo.policy_loss import PolicyLossConfig, loss_normalizer, policy_loss, policy_objective

D = torch.float64
DOC = Path(__file__).resolve().parents[1] / "docs" / "algorithm.md"
PROPS = settings(max_examples=50, deadline=None)


def make_batch(seed: int, b: int = 5, t: int = 7, prox: float = 0.3, mis: float = 0.3, min_len: int = 1):
    """Random float64 batch: logp (with grad), logp_old, logp_sampler, mask [B, T] and adv [B]."""
    g = torch.Generator().manual_seed(seed)
    lengths_B = torch.randint(min_len, t + 1, (b,), generator=g)
    mask_BT = torch.arange(t)[None, :] < lengths_B[:, None]
    old_BT = -3.0 * torch.rand(b, t, generator=g, dtype=D) - 0.05
    logp_BT = (old_BT + prox * torch.randn(b, t, generator=g, dtype=D)).requires_grad_()
    sampler_BT = old_BT - mis * torch.randn(b, t, generator=g, dtype=D)
    adv_B = torch.randn(b, generator=g, dtype=D)
    return logp_BT, old_BT, sampler_BT, mask_BT, adv_B


def one(ratios: list[float], adv: float, weights: list[float] | None = None):
    """A single response whose token ratios (and mismatch weights old/sampler) are the given numbers."""
    old = torch.full((1, len(ratios)), -1.0, dtype=D)
    logp = (old + torch.tensor([ratios], dtype=D).log()).requires_grad_()
    sampler = old - torch.tensor([weights or [1.0] * len(ratios)], dtype=D).log()
    return logp, old, sampler, torch.ones_like(old, dtype=torch.bool), torch.tensor([adv], dtype=D)


def loss_and_grad(batch, cfg: PolicyLossConfig, normalizer: float | None = None):
    loss, metrics = policy_loss(*batch, cfg, normalizer=normalizer)
    (grad,) = torch.autograd.grad(loss, batch[0], allow_unused=True)
    return loss.detach(), (torch.zeros_like(batch[0]) if grad is None else grad), metrics


def close(x: torch.Tensor, expected: list, atol: float = 1e-12) -> bool:
    return torch.allclose(x, torch.tensor(expected, dtype=x.dtype), atol=atol, rtol=0)


# customary starting points per mode (the tests' configs): DAPO's clip-higher for token PPO, GSPO's sequence
# clip, TBPO's defaults
MODE_DEFAULTS: dict[str, dict[str, object]] = {
    "token_ppo": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "dual_clip_c": None},
    "tbpo": {"eps_low": 3e-4, "eps_high": 4e-4, "dual_clip_c": 3.0},
}


def for_mode(mode: str, **overrides: object) -> PolicyLossConfig:
    """A config with the customary clip range of ``mode`` (MODE_DEFAULTS), then ``overrides``."""
    return PolicyLossConfig(**{"mode": mode, **MODE_DEFAULTS[mode], **overrides})


TOKEN = for_mode("token_ppo")


# ---------------------------------------------------------------- config
def test_defaults_are_the_documented_tbpo_ones() -> None:
    cfg = PolicyLossConfig()
    assert (cfg.mode, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c) == ("tbpo", 3e-4, 4e-4, 3.0)
    assert (cfg.w_low, cfg.w_high, cfg.delta_low, cfg.delta_high) == (0.5, 2.0, 0.2, 0.2)
    assert (cfg.mismatch, cfg.aggregation, cfg.tis_cap) == ("none", "seq_mean_token_mean", 2.0)
    assert (TOKEN.eps_low, TOKEN.eps_high) == (0.2, 0.28)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"eps_low": 1.0}, "eps_low must be in"),
        ({"eps_high": -0.1}, "eps_high must be >= 0"),
        ({"dual_clip_c": 1.0}, "dual_clip_c must be > 1"),
        ({"w_low": 2.0, "w_high": 1.0}, "w_low .* must be < w_high"),
        ({"w_low": 0.0}, "w_low must be > 0"),
        ({"mismatch": "tis_token"}, "TBPO applies its own"),
        ({"mode": "gspo", "mismatch": "mis_token"}, "is token-level"),
        ({"aggregation": "seq_mean_token_sum"}, "needs norm_len"),
        ({"mode": "grpo"}, "mode"),
        ({"eps": 0.2}, "extra"),
    ],
)
def test_config_rejects_bad_values(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PolicyLossConfig(**fields)


# ---------------------------------------------------------------- hand-computed cases
def test_token_ppo_clip_higher_hand_computed() -> None:
    loss, grad, m = loss_and_grad(one([1.5, 0.5, 1.1], +1.0), TOKEN)
    assert float(loss) == pytest.approx(-(1.28 + 0.5 + 1.1) / 3, abs=1e-12)  # 1.5 clipped at 1 + 0.28
    assert grad.tolist()[0] == pytest.approx([0.0, -0.5 / 3, -1.1 / 3], abs=1e-12)
    assert float(m["clip_frac_high"]) == pytest.approx(1 / 3) and float(m["clip_frac_low"]) == 0.0
    loss, grad, m = loss_and_grad(one([1.5, 0.5, 1.1], -1.0), TOKEN)
    assert float(loss) == pytest.approx((1.5 + 0.8 + 1.1) / 3, abs=1e-12)  # 0.5 clipped at 1 - 0.2
    assert grad.tolist()[0] == pytest.approx([0.5, 0.0, 1.1 / 3], abs=1e-12)
    assert float(m["clip_frac_low"]) == pytest.approx(1 / 3) and float(m["ratio_max"]) == pytest.approx(1.5)


def test_dual_clip_hand_computed() -> None:
    loss, grad, m = loss_and_grad(one([4.0, 1.0], -1.0), TOKEN)  # max(-4, 3 * -1) = -3
    assert float(loss) == pytest.approx((3.0 + 1.0) / 2, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.5], abs=1e-12)
    assert float(m["dual_clip_frac"]) == pytest.approx(0.5)
    loss, grad, _ = loss_and_grad(one([4.0, 1.0], -1.0), TOKEN.model_copy(update={"dual_clip_c": None}))
    assert float(loss) == pytest.approx((4.0 + 1.0) / 2, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([2.0, 0.5], abs=1e-12)


def test_gspo_hand_computed() -> None:
    cfg = for_mode("gspo", eps_low=0.05, eps_high=0.08)
    s = (1.5 * 0.5 * 1.1) ** (1 / 3)  # 0.9378 < 1 - 0.05
    loss, grad, m = loss_and_grad(one([1.5, 0.5, 1.1], +1.0), cfg)
    assert float(loss) == pytest.approx(-s, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([-s / 3] * 3, abs=1e-12)
    loss, grad, m = loss_and_grad(one([1.5, 0.5, 1.1], -1.0), cfg)
    assert float(loss) == pytest.approx(0.95, abs=1e-12) and float(grad.abs().sum()) == 0.0
    assert float(m["clip_frac_low"]) == 1.0 and float(m["seq_ratio_mean"]) == pytest.approx(s)


@pytest.mark.parametrize(
    ("mode", "mismatch", "update", "expected_obj", "masked"),
    [
        ("token_ppo", "tis_token", {}, (2.0 + 1.0 + 0.4) / 3, 0.0),  # min(w, 2)
        ("token_ppo", "mis_token", {}, 1.0 / 3, 2 / 3),  # w = 3 and 0.4 leave [0.5, 2]
        ("token_ppo", "tis_seq", {}, 1.2 ** (1 / 3), 0.0),  # s_mis = (3 * 1 * 0.4)^(1/3)
        ("token_ppo", "mis_seq", {}, 1.2 ** (1 / 3), 0.0),
        ("token_ppo", "mis_seq", {"w_high": 1.05}, 0.0, 1.0),
        ("gspo", "tis_seq", {"tis_cap": 1.05}, 1.05, 0.0),
        ("gspo", "mis_seq", {}, 1.2 ** (1 / 3), 0.0),
    ],
)
def test_mismatch_corrections_hand_computed(mode, mismatch, update, expected_obj, masked) -> None:
    cfg = for_mode(mode, mismatch=mismatch, **update)
    loss, _, m = loss_and_grad(one([1.0, 1.0, 1.0], +1.0, weights=[3.0, 1.0, 0.4]), cfg)
    assert float(loss) == pytest.approx(-expected_obj, abs=1e-12)
    assert float(m["mis_masked_frac"]) == pytest.approx(masked)
    assert float(m["tis_truncated_frac"]) == pytest.approx(
        {"tis_token": 1 / 3}.get(mismatch, 0.0) + (1.0 if update.get("tis_cap") else 0.0)
    )


def test_tbpo_bands_and_dual_clip_hand_computed() -> None:
    # response 0 in both bands (A = 2, s_prox = 1, s_mis = 1.2^(1/3)); response 1 has s_mis = e > 2 (A = -1)
    old = torch.full((2, 3), -1.0, dtype=D)
    logp = old.clone().requires_grad_()
    sampler = old - torch.tensor([[math.log(3.0), 0.0, math.log(0.4)], [1.0, 1.0, 1.0]], dtype=D)
    batch = (logp, old, sampler, torch.ones(2, 3, dtype=torch.bool), torch.tensor([2.0, -1.0], dtype=D))
    loss, grad, m = loss_and_grad(batch, PolicyLossConfig())
    s_mis = 1.2 ** (1 / 3)
    assert float(loss) == pytest.approx(-(s_mis * 2.0 + 0.0) / 2, abs=1e-12)
    assert close(grad, [[-s_mis * 2.0 / 2 / 3] * 3, [0.0] * 3])
    keys = ("band_masked_frac", "band_mis_masked_frac_neg", "band_mis_masked_frac_pos")
    assert [float(m[k]) for k in keys] == [0.5, 1.0, 0.0]
    # s_prox = 4: outside the default band (masked), dual-clipped at c * A = -3 inside a wide band
    loss, grad, m = loss_and_grad(one([4.0, 4.0], -1.0), PolicyLossConfig())
    assert float(loss) == 0.0 and not grad.any() and float(m["band_prox_masked_frac_neg"]) == 1.0
    loss, grad, m = loss_and_grad(one([4.0, 4.0], -1.0), PolicyLossConfig(delta_high=5.0))
    assert float(loss) == pytest.approx(3.0, abs=1e-12) and float(grad.abs().sum()) == 0.0
    assert float(m["dual_clip_frac"]) == 1.0 and float(m["band_masked_frac"]) == 0.0
    # lower edge of the ratio band: s_prox = 0.7 < 1 - 0.2
    loss, _, m = loss_and_grad(one([0.7, 0.7], +1.0), PolicyLossConfig())
    assert float(loss) == 0.0 and float(m["band_prox_masked_frac_pos"]) == 1.0


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [("seq_mean_token_mean", 0.0), ("token_mean", 0.5), ("seq_mean_token_sum", 0.25)],
)
def test_aggregations_hand_computed(aggregation: str, expected: float) -> None:
    # response 0: one token with objective +1; response 1: three tokens with objective -1 each
    old = torch.full((2, 3), -1.0, dtype=D)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    batch = (old.clone().requires_grad_(), old, old, mask, torch.tensor([1.0, -1.0], dtype=D))
    cfg = TOKEN.model_copy(update={"aggregation": aggregation, "norm_len": 4})
    assert float(policy_loss(*batch, cfg)[0].detach()) == pytest.approx(expected, abs=1e-12)


def test_worked_example_of_the_docs() -> None:
    """docs/algorithm.md, section "Worked example": the numbers there are checked here to 1e-6."""
    old = torch.tensor(
        [[-0.5, -1.0, -0.3], [-0.7, -1.2, 0.0], [-0.4, -0.9, -1.5], [-0.2, math.log(1e-6), math.log(1e-6)]],
        dtype=D,
    )
    logp = (
        old + torch.tensor([[0.003, 0, 0], [0.002, 0, 0], [-0.0015, 0, 0], [0, 0, 0]], dtype=D)
    ).requires_grad_()
    sampler = old - torch.tensor([[0, 0, 0], [0.1, 0.1, 0], [0, 0, 0], [0, 0, 0]], dtype=D)
    sampler[3, 1:] = math.log(0.01)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D), group_size=2)
    batch = (logp, old, sampler, mask, adv)
    expected = {
        "A": [0.70710578, -0.70710578, 0.70710578, -0.70710578],
        "J": [0.70738862, -0.78225461, 0.70675232, 0.0],
        "loss": -0.15797158,
        "grad_r2": 0.09778183,
        "grad_r3": -0.05889603,
        "token_ppo_loss": 0.00008823,
        "token_ppo_grad_r4": 0.05892548,
    }
    assert adv.tolist() == pytest.approx(expected["A"], abs=1e-6)
    out = policy_objective(*batch)
    assert sequence_mean_B(out.obj_BT, batch[3]).tolist() == pytest.approx(expected["J"], abs=1e-6)
    loss, grad, m = loss_and_grad(batch, PolicyLossConfig())
    assert float(loss) == pytest.approx(expected["loss"], abs=1e-6)
    assert close(
        grad, [[0.0] * 3, [expected["grad_r2"]] * 2 + [0.0], [expected["grad_r3"]] * 3, [0.0] * 3], 1e-6
    )
    keys = ("clip_frac", "band_masked_frac_pos", "band_masked_frac_neg")
    assert [float(m[k]) for k in keys] == [0.25, 0.0, 0.5]
    loss, grad, _ = loss_and_grad(batch, TOKEN)
    assert float(loss) == pytest.approx(expected["token_ppo_loss"], abs=1e-6)
    assert grad[3].tolist() == pytest.approx([expected["token_ppo_grad_r4"]] * 3, abs=1e-6)
    text = DOC.read_text()
    for value in [0.70710578, *expected["J"][:3], *list(expected.values())[2:]]:
        assert f"{value:.8f}" in text, f"{value:.8f} missing from {DOC}"


# ---------------------------------------------------------------- autograd vs a direct re-statement
def reference_loss(logp, old, sampler, mask, adv, cfg: PolicyLossConfig) -> torch.Tensor:
    """The formulas of docs/algorithm.md written out response by response."""

    def clipobj(x: torch.Tensor, a: float) -> torch.Tensor:
        obj = torch.minimum(x * a, torch.clamp(x, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
        return (
            torch.maximum(obj, torch.full_like(obj, cfg.dual_clip_c * a))
            if cfg.dual_clip_c and a < 0
            else obj
        )

    sums, lengths = [], []
    for i in range(logp.shape[0]):
        lp, lo, ls, a = logp[i][mask[i]], old[i][mask[i]], sampler[i][mask[i]], float(adv[i])
        if lp.numel() == 0:
            continue
        w, s_mis = torch.exp(lo - ls), float(torch.exp((lo - ls).mean()))
        seq_weight = {
            "tis_seq": min(s_mis, cfg.tis_cap),
            "mis_seq": s_mis * (cfg.w_low <= s_mis <= cfg.w_high),
        }
        if cfg.mode == "token_ppo":
            obj = clipobj(torch.exp(lp - lo), a)
            if cfg.mismatch == "tis_token":
                obj = obj * torch.clamp(w, max=cfg.tis_cap)
            elif cfg.mismatch == "mis_token":
                obj = obj * w * ((w >= cfg.w_low) & (w <= cfg.w_high))
            total = obj.sum() * seq_weight.get(cfg.mismatch, 1.0)
        else:
            s = torch.exp((lp - lo).mean())
            j = clipobj(s, a) * seq_weight.get(cfg.mismatch, 1.0)
            if cfg.mode == "tbpo":
                in_band = (
                    cfg.w_low <= s_mis <= cfg.w_high
                    and 1 - cfg.delta_low <= float(s.detach()) <= 1 + cfg.delta_high
                )
                j = j * s_mis * in_band
            total = j * lp.numel()
        sums.append(total)
        lengths.append(lp.numel())
    if cfg.aggregation == "token_mean":
        return -sum(sums) / sum(lengths)
    if cfg.aggregation == "seq_mean_token_sum":
        return -sum(sums) / cfg.norm_len / len(sums)
    return -sum(s / n for s, n in zip(sums, lengths, strict=True)) / len(sums)


_TOKEN_MISMATCH = ("none", "tis_token", "mis_token", "tis_seq", "mis_seq")
CONFIGS = [
    *(for_mode("token_ppo", mismatch=m) for m in _TOKEN_MISMATCH),
    for_mode("token_ppo", dual_clip_c=None, eps_low=0.1),
    for_mode("gspo"),
    *(
        for_mode("gspo", mismatch=m, eps_low=0.05, eps_high=0.08)
        for m in ("tis_seq", "mis_seq")
    ),
    PolicyLossConfig(),
    PolicyLossConfig(eps_low=0.05, eps_high=0.08, dual_clip_c=1.1, delta_high=0.5),
]


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.mismatch}-{c.eps_low}")
def test_gradient_matches_autograd_of_reference(cfg: PolicyLossConfig, aggregation: str) -> None:
    cfg = cfg.model_copy(update={"aggregation": aggregation, "norm_len": 6})
    for seed in range(4):
        batch = make_batch(seed, b=6, t=6, prox=0.3, mis=0.6)
        loss, grad, _ = loss_and_grad(batch, cfg)
        ref = reference_loss(*batch, cfg)
        (ref_grad,) = torch.autograd.grad(ref, batch[0])
        assert float(loss) == pytest.approx(float(ref.detach()), abs=1e-12)
        assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)


def test_reference_batches_exercise_bands_and_clips() -> None:
    metrics = [
        policy_loss(*make_batch(s, b=6, t=6, prox=0.3, mis=0.6), PolicyLossConfig())[1] for s in range(4)
    ]
    assert sum(float(m["band_prox_masked_frac"]) for m in metrics) > 0
    assert sum(float(m["band_mis_masked_frac"]) for m in metrics) > 0
    assert sum(float(m["clip_frac"]) for m in metrics) > 0


# ---------------------------------------------------------------- micro-batches, padding, precision, metrics
@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"])
def test_micro_batches_sum_to_global_loss_with_normalizer(aggregation: str) -> None:
    cfg = TOKEN.model_copy(update={"aggregation": aggregation, "norm_len": 7, "mismatch": "tis_token"})
    batch = make_batch(3, b=6)
    loss, grad, _ = loss_and_grad(batch, cfg)
    total = sum(loss_normalizer(batch[3][sl], cfg) for sl in (slice(0, 2), slice(2, 6)))
    parts = [
        loss_and_grad(tuple(x[sl] for x in batch), cfg, normalizer=total) for sl in (slice(0, 2), slice(2, 6))
    ]
    assert float(parts[0][0] + parts[1][0]) == pytest.approx(float(loss), abs=1e-12)
    assert torch.allclose(grad, torch.cat([parts[0][1], parts[1][1]]), atol=1e-12)


def test_nonfinite_padding_is_ignored() -> None:
    batch = make_batch(5, b=4, t=6, min_len=1)
    ref_loss, ref_grad, ref_m = loss_and_grad(batch, PolicyLossConfig())
    logp, old, sampler, mask, adv = batch
    pad = ~mask
    dirty_logp = torch.where(pad, float("-inf"), logp.detach()).requires_grad_()
    dirty = (
        dirty_logp,
        torch.where(pad, float("nan"), old),
        torch.where(pad, float("inf"), sampler),
        mask,
        adv,
    )
    loss, grad, m = loss_and_grad(dirty, PolicyLossConfig())
    assert float(loss) == float(ref_loss) and torch.equal(grad, ref_grad)
    assert all(float(m[k]) == pytest.approx(float(ref_m[k]), abs=1e-12) for k in ref_m)


def test_half_precision_inputs_compute_in_float32() -> None:
    batch = make_batch(7, prox=0.05, mis=0.05)
    ref = float(policy_loss(*batch, TOKEN)[0].detach())
    low = [x.detach().to(torch.bfloat16) if x.is_floating_point() else x for x in batch]
    low[0].requires_grad_()
    loss, _ = policy_loss(*low, TOKEN)
    assert loss.dtype == torch.float32 and abs(float(loss.detach()) - ref) < 3e-2


def test_metric_keys_are_stable_across_modes() -> None:
    keys = None
    for cfg in CONFIGS:
        _, metrics = policy_loss(*make_batch(1), cfg)
        assert all(v.dim() == 0 and not v.requires_grad and v.dtype == D for v in metrics.values())
        keys = keys or set(metrics)
        assert set(metrics) == keys
    for name in sorted(keys):
        assert f"`{name}`" in DOC.read_text(), f"metric {name} is not documented in {DOC}"


# ---------------------------------------------------------------- properties
batch_args = {"seed": st.integers(0, 2**20), "b": st.integers(1, 6), "t": st.integers(1, 8)}


@PROPS
@given(
    **batch_args,
    which=st.integers(0, 5),
    band=st.sampled_from(["mis_high", "mis_low", "prox_high", "prox_low"]),
)
def test_response_outside_a_band_gets_exactly_zero_gradient(seed, b, t, which, band) -> None:
    logp, old, sampler, mask, adv = make_batch(seed, b, t, prox=0.05, mis=0.05)
    i, shift = which % b, {"mis_high": -1.0, "mis_low": 1.0, "prox_high": 0.5, "prox_low": -0.5}[band]
    if band.startswith("mis"):
        sampler = sampler.clone()
        sampler[i] += shift  # logp_old - logp_sampler moves by -shift on every token
    else:
        logp = (
            logp.detach() + shift * torch.nn.functional.one_hot(torch.tensor(i), b)[:, None]
        ).requires_grad_()
    _, grad, m = loss_and_grad((logp, old, sampler, mask, adv), PolicyLossConfig())
    assert torch.equal(grad[i], torch.zeros_like(grad[i]))
    assert float(m["band_masked_frac"]) >= 1 / b - 1e-12


WIDE_TBPO = PolicyLossConfig(delta_high=50.0, delta_low=0.99)  # bands wide enough for the dual clip to act
GSPO_DUAL = for_mode("gspo", dual_clip_c=3.0)


@PROPS
@given(**batch_args, aggregation=st.sampled_from(["seq_mean_token_mean", "token_mean"]))
def test_on_policy_tbpo_gradient_is_the_group_policy_gradient(seed, b, t, aggregation) -> None:
    logp, _, _, mask, adv = make_batch(seed, b, t)
    same = logp.detach()
    _, grad, _ = loss_and_grad((logp, same, same, mask, adv), PolicyLossConfig(aggregation=aggregation))
    lengths = mask.sum(-1, keepdim=True).to(D)
    per_token = (
        adv[:, None] / lengths / b if aggregation == "seq_mean_token_mean" else adv[:, None] / mask.sum()
    )
    assert torch.allclose(grad, -per_token * mask, atol=1e-12, rtol=0)


@PROPS
@given(**batch_args, cfg=st.sampled_from([WIDE_TBPO, PolicyLossConfig(), TOKEN, GSPO_DUAL]))
def test_negative_advantage_loss_never_exceeds_c_abs_adv(seed, b, t, cfg) -> None:
    logp, old, sampler, mask, adv = make_batch(seed, b, t, prox=3.0, mis=0.3)
    out = policy_objective(logp, old, sampler, mask, -adv.abs(), cfg)
    s_mis = torch.exp(((old - sampler) * mask).sum(-1) / mask.sum(-1)) if cfg.mode == "tbpo" else 1.0
    assert bool((-sequence_mean_B(out.obj_BT, mask) <= cfg.dual_clip_c * adv.abs() * s_mis + 1e-9).all())


@PROPS
@given(**batch_args, extra=st.integers(1, 5), cfg=st.sampled_from(CONFIGS))
def test_extra_padding_changes_nothing(seed, b, t, extra, cfg) -> None:
    batch = make_batch(seed, b, t)
    loss, grad, m = loss_and_grad(batch, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    padded = [torch.cat([x.detach(), torch.randn(b, extra, generator=g, dtype=D) * 5], 1) for x in batch[:3]]
    padded_mask = torch.cat([batch[3], torch.zeros(b, extra, dtype=torch.bool)], 1)
    padded[0].requires_grad_()
    loss2, grad2, m2 = loss_and_grad((*padded, padded_mask, batch[4]), cfg)
    assert float(loss2) == pytest.approx(float(loss), abs=1e-12)
    assert torch.allclose(grad2[:, :t], grad, atol=1e-12) and not grad2[:, t:].any()
    assert all(float(m2[k]) == pytest.approx(float(m[k]), abs=1e-12) for k in m)


@PROPS
@given(**batch_args, cfg=st.sampled_from(CONFIGS))
def test_shuffling_responses_changes_nothing(seed, b, t, cfg) -> None:
    batch = make_batch(seed, b, t)
    loss, grad, m = loss_and_grad(batch, cfg)
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    shuffled = [x.detach()[perm] for x in batch]
    shuffled[0].requires_grad_()
    loss2, grad2, m2 = loss_and_grad(tuple(shuffled), cfg)
    assert float(loss2) == pytest.approx(float(loss), abs=1e-12)
    assert torch.allclose(grad2, grad[perm], atol=1e-12)
    assert all(float(m2[k]) == pytest.approx(float(m[k]), abs=1e-12) for k in m)
