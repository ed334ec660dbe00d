"""benchmarks/repro_mini.py: cells and their overrides, resumability, aggregation (never a claim inside the
seed spread), the estimate; and the two trainer options it relies on (reward.shuffle, train.save_log_ratios)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_qarl.data.reward import RewardConfig, shuffle_rewards_in_groups
from megatron_qarl.errors import ConfigError
from megatron_qarl.preflight.rules import load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def repro():
    spec = importlib.util.spec_from_file_location("repro_mini", REPO / "benchmarks" / "repro_mini.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["repro_mini"] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def _setting(repro, argv: list[str]):
    import argparse

    ns = argparse.Namespace(smoke=False, steps=None, seeds=None, bits="4,3,2", arms=",".join(repro.PAPER_ARMS),
                            controls="fp,qarl_tbpo@2", eval_every=None, eval_n=None, overrides=[],
                            rollout_dtype="float32")
    for item in argv:
        k, v = item.split("=", 1)
        setattr(ns, k, v if k not in ("steps", "eval_every", "eval_n", "smoke") else int(v))
    return repro.build_setting(ns)


def test_cells_cover_arms_bits_and_controls(repro):
    s = _setting(repro, [])
    names = [c.name for c in s.cells()]
    assert names == ["fp", "unaligned_tis_w4", "unaligned_tis_w3", "unaligned_tis_w2", "qarl_grpo_w4",
                     "qarl_grpo_w3", "qarl_grpo_w2", "qarl_tbpo_w4", "qarl_tbpo_w3", "qarl_tbpo_w2",
                     "fp_shuffled", "qarl_tbpo_w2_shuffled"]  # fmt: skip
    assert s.seeds == (1, 2, 3) and s.steps == 40
    smoke = _setting(repro, ["smoke=1"])
    assert smoke.seeds == (1,) and smoke.steps == 2 and len(smoke.cells()) == 12


@pytest.mark.parametrize("cell_args", [("fp", None, False), ("unaligned_tis", 3, False), ("qarl_grpo", 2, False),
                                       ("qarl_tbpo", 4, False), ("qarl_tbpo", 2, True), ("unaligned_tis_r3", 2, False),
                                       ("qarl_tbpo_r3", 3, False)])  # fmt: skip
def test_every_cell_is_a_valid_qarl_config(repro, cell_args, tmp_path):
    s = _setting(repro, ["seeds=7"])
    cell = repro.Cell(*cell_args)
    cfg = load_config(REPO / repro.BASE_CONFIG, s.cell_overrides(cell, 7, tmp_path / "run"))
    assert cfg.seed == 7 and cfg.data.synthetic.seed == 7  # a seed changes the run seed and the data seed
    assert cfg.launch.backend == "local" and cfg.train.save_log_ratios and cfg.train.steps == 40
    assert cfg.rollout.dtype == "float32"  # pinned: the configs' default may change
    assert cfg.reward.shuffle == cell.shuffled
    arm = cell.arm.removesuffix("_r3")
    assert cfg.algo.routing_replay == cell.arm.endswith("_r3")
    assert cfg.quant.enabled == (arm != "fp")
    if cfg.quant.enabled:
        assert cfg.quant.num_bits == cell.bits
    assert cfg.learner.aligned == (arm != "unaligned_tis")
    assert cfg.algo.loss.mode == ("tbpo" if arm == "qarl_tbpo" else "token_ppo")
    assert cfg.algo.loss.mismatch == ("tis_token" if arm == "unaligned_tis" else "none")


def test_every_arm_has_a_plot_colour(repro):
    """The report's plots colour each arm (the exact arms once had none: their report crashed after 27 minutes)."""
    assert set(repro._colors()) == set(repro.ARMS)


def test_bad_arguments_are_named(repro):
    with pytest.raises(SystemExit, match="--bits: 5"):
        _setting(repro, ["bits=4,5"])
    with pytest.raises(SystemExit, match="--arms: unknown arm 'bf16'"):
        _setting(repro, ["arms=bf16"])
    with pytest.raises(SystemExit, match="give a bit width"):
        _setting(repro, ["controls=qarl_tbpo"])
    with pytest.raises(SystemExit, match="outside --bits"):
        _setting(repro, ["bits=4", "controls=qarl_tbpo@2"])


def _fake_run(repro, out: Path, setting, cell, seed: int, acc: list[float], mismatch: float, wall: float = 60.0):
    """A finished run directory as qarl train + run_cell leave it."""
    import numpy as np

    d = out / cell.name / f"seed{seed}"
    (d / "log_ratios").mkdir(parents=True)
    rows = [{"step": 0, "eval/greedy_accuracy": acc[0], "time/eval_s": 2.0}]
    for step in range(1, setting.steps + 1):
        row = {"step": step, "time/step_s": 5.0, "throughput/rollout_tokens_per_s": 1000.0,
               "mismatch/mismatch_tok_abs_mean": mismatch, "mismatch/mismatch_tok_abs_p99": 10 * mismatch,
               "loss/band_masked_frac": 0.0, "loss/clip_frac": 0.01, "loss/tis_truncated_frac": 0.0,
               "error_tokens/err_low_prob_frac": 0.01, "error_tokens/err_repeat_rate": 0.0, "reward/mean": 0.5}
        if step == setting.steps:
            row.update({"eval/greedy_accuracy": acc[1], "time/eval_s": 2.0})
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text("{}")
    np.save(d / "log_ratios" / f"step_{setting.steps:06d}.npy", np.full(100, mismatch, dtype=np.float32))
    rec = {"cell": cell.name, "arm": cell.arm, "bits": cell.bits, "shuffled": cell.shuffled, "seed": seed,
           "overrides": setting.cell_overrides(cell, seed, d), "wall_s": wall}
    (d / "repro_cell.json").write_text(json.dumps(rec))


def test_report_calls_only_differences_beyond_the_seed_spread(repro, tmp_path):
    s = _setting(repro, ["bits=2", "arms=fp,unaligned_tis,qarl_tbpo", "controls=", "steps=3", "eval_every=0"])
    Cell = repro.Cell
    finals = {Cell("fp", None): [0.80, 0.82, 0.84], Cell("unaligned_tis", 2): [0.30, 0.45, 0.60],
              Cell("qarl_tbpo", 2): [0.70, 0.72, 0.74]}  # fmt: skip
    mismatch = {"fp": 2e-7, "unaligned_tis": 0.5, "qarl_tbpo": 2e-7}
    for cell, accs in finals.items():
        for seed, acc in zip(s.seeds, accs, strict=True):
            _fake_run(repro, tmp_path / "runs", s, cell, seed, [0.4, acc], mismatch[cell.arm])
    found = repro.collect(tmp_path / "runs", s)
    assert sorted(c.name for c in found) == ["fp", "qarl_tbpo_w2", "unaligned_tis_w2"]
    doc = tmp_path / "docs" / "REPRODUCTION.md"
    repro.write_report(found, s, doc, "cmd", False, [])
    text = doc.read_text()
    assert "| `fp` | 1,2,3 | 40.0 | 82.0 ± 2.0 [80.0, 84.0] | 82.0 ± 2.0 [80.0, 84.0] | 2e-07 |" in text
    # fp (80-84) vs qarl_tbpo (70-74): 10 points > spread 4 -> called
    assert ("| 2 | `fp` vs `qarl_tbpo_w2` | 82.0 vs 72.0, Δ +10.0 > seed spread 4.0, ranges apart: **fp higher** |"
            in text)
    # unaligned (30-60) vs qarl_tbpo (70-74): ranges apart, but 27 points < spread 30 -> not called
    assert ("| 2 | `unaligned_tis_w2` vs `qarl_tbpo_w2` | 45.0 vs 72.0, Δ -27.0 within the seed spread 30.0 "
            "(ranges apart): no difference claimed |") in text
    assert "alignment shrinks it 2.5e+06x (at least 100x: yes)" in text
    for png in ("accuracy.png", "mismatch.png", "log_ratio_hist.png"):
        assert (doc.parent / "repro" / png).stat().st_size > 1000
    # a bf16 server: the aligned arms sit on the fp arm's floor, and the note says so
    bf16 = repro.Setting(3, (1, 2, 3), (2,), s.arms, (), 0, 200, (), "bfloat16")
    text = "\n".join(repro.mismatch_lines({Cell("fp", None): found[Cell("fp", None)][:1],
                                           Cell("unaligned_tis", 2): found[Cell("unaligned_tis", 2)][:1],
                                           Cell("qarl_tbpo", 2): found[Cell("qarl_tbpo", 2)][:1]}, bf16))
    assert "(at least 100x: yes)" in text  # 0.5 vs 2e-7
    low = {c: [repro.SeedRun(1, [{"step": 1, "time/step_s": 1.0, "mismatch/mismatch_tok_abs_mean": m}], None, [], [])]
           for c, m in ((Cell("fp", None), 3e-3), (Cell("unaligned_tis", 2), 1e-2), (Cell("qarl_tbpo", 2), 3e-3))}
    text = "\n".join(repro.mismatch_lines(low, bf16))
    assert ("alignment shrinks it 3.33x (LESS than 100x; the aligned arm is at 1x the full-precision arm's 0.003, "
            "which has no quantization at all: that floor is the server computing in rollout.dtype=bfloat16") in text
    # one seed: nothing is called
    one = repro.collect(tmp_path / "runs", repro.Setting(3, (1,), (2,), s.arms, (), 0, 200, ()))
    rows = repro.comparisons(one, s)[2:]
    assert len(rows) == 3 and all(r.count("fewer than 2 seeds, no spread measured, no difference claimed") == 2
                                  for r in rows)


def test_finished_runs_are_skipped_and_other_settings_refused(repro, tmp_path):
    s = _setting(repro, ["bits=2", "arms=fp", "controls=", "steps=3", "seeds=1"])
    cell = repro.Cell("fp", None)
    _fake_run(repro, tmp_path, s, cell, 1, [0.4, 0.5], 1e-7)
    assert repro.run_cell(s, cell, 1, tmp_path, False, 10) == "done"  # no subprocess started
    other = _setting(repro, ["bits=2", "arms=fp", "controls=", "steps=4", "seeds=1"])
    with pytest.raises(SystemExit, match="holds a run with other settings"):
        repro.run_cell(other, cell, 1, tmp_path, False, 10)


def test_estimate_scales_steps_and_evals(repro, tmp_path):
    smoke = _setting(repro, ["bits=2", "arms=fp", "controls=", "steps=2", "seeds=1", "eval_every=0", "eval_n=50"])
    _fake_run(repro, tmp_path, smoke, repro.Cell("fp", None), 1, [0.4, 0.5], 1e-7, wall=30.0)
    # measured: 2 steps x 5 s, 2 evals x 2 s (50 problems) -> overhead 16 s
    full = _setting(repro, ["bits=2", "arms=fp", "controls=", "steps=10", "seeds=1,2", "eval_every=5",
                            "eval_n=100"])  # fmt: skip
    secs = repro.estimate_seconds(full, repro.collect_any(tmp_path))
    assert secs == pytest.approx(2 * (16 + 10 * 5 + 3 * 100 * 2 / 50))


# ------------------------------------------------------------------------------------ trainer options
def test_shuffled_rewards_keep_each_group_and_are_seeded():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    a = shuffle_rewards_in_groups(rewards, 4, seed=3, step=5)
    assert sorted(a[:4]) == sorted(rewards[:4]) and sorted(a[4:]) == sorted(rewards[4:])
    assert a == shuffle_rewards_in_groups(rewards, 4, seed=3, step=5)
    many = {tuple(shuffle_rewards_in_groups(rewards, 4, seed=3, step=s)) for s in range(20)}
    assert len(many) > 1
    with pytest.raises(ValueError, match="groups of 3"):
        shuffle_rewards_in_groups(rewards, 3, 0, 0)


def test_config_options_default_off_and_are_validated():
    cfg = load_config(REPO / "configs" / "cpu_default.yaml")
    assert cfg.reward.shuffle is False and cfg.train.save_log_ratios is False
    assert RewardConfig(shuffle=True).shuffle
    with pytest.raises(ConfigError, match="reward.shuffle"):
        load_config(REPO / "configs" / "cpu_default.yaml", ["reward.shuffle=maybe"])
    with pytest.raises(ConfigError, match="train.save_log_ratios"):
        load_config(REPO / "configs" / "cpu_default.yaml", ["train.save_log_ratios=3"])


def test_overrides_are_key_value_anywhere_on_the_line_as_every_command_takes_them(repro, tmp_path, capsys):
    argv = ["--arms", "qarl_tbpo", "train.prompts_per_step=4", "--bits", "2", "--controls", "", "--steps", "1",
            "--seeds", "1", "--out", str(tmp_path), "--plan", "rollout.threads=1"]
    assert repro.main(argv) == 0
    run = capsys.readouterr().out.split("one run: ", 1)[1]
    assert "quant.num_bits=2 train.prompts_per_step=4 rollout.threads=1 train.output_dir=" in run, run


@pytest.mark.e2e
def test_repro_runs_cells_end_to_end_and_resumes(repro, tmp_path):
    """Two small real runs (QaRL+TBPO at 2 bits, fp with shuffled rewards: an arm and a control), then a rerun
    skips them."""
    argv = ["--arms", "qarl_tbpo", "--bits", "2", "--controls", "fp", "--steps", "1", "--seeds", "1",
            "--eval-every", "0", "--eval-n", "8", "train.prompts_per_step=4",
            "rollout.sampling.n_samples=4", "rollout.threads=1", "--out", str(tmp_path / "runs"),
            "--doc", str(tmp_path / "REPRODUCTION.md")]  # fmt: skip
    assert repro.main(argv) == 0
    text = (tmp_path / "REPRODUCTION.md").read_text()
    assert "`qarl_tbpo_w2`" in text and "`fp_shuffled`" in text
    tbpo = tmp_path / "runs" / "qarl_tbpo_w2" / "seed1"
    assert list((tbpo / "log_ratios").glob("step_*.npy"))
    rows = [json.loads(x) for x in (tbpo / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("mismatch/mismatch_tok_abs_mean", 0) for r in rows) < 1e-5  # aligned at 2 bits
    assert not (tbpo / "checkpoints").exists()
    mtime = (tbpo / "metrics.jsonl").stat().st_mtime
    assert repro.main(argv) == 0  # everything finished: nothing reruns
    assert (tbpo / "metrics.jsonl").stat().st_mtime == mtime
