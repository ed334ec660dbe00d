"""A miniature reproduction of the QaRL paper's comparison on the project's tiny Qwen3-MoE (issue 8).

    .venv/bin/python benchmarks/repro_mini.py --smoke                 # every cell, 1 seed, 2 steps (minutes)
    .venv/bin/python benchmarks/repro_mini.py                         # the study (hours; see --plan)
    .venv/bin/python benchmarks/repro_mini.py --plan --timings-from runs/repro_mini_smoke   # cells + estimate
    .venv/bin/python benchmarks/repro_mini.py --aggregate-only        # rewrite the report from finished cells

Arms (same data and seeds in every arm; the weight bit width b is swept over --bits):
  fp             (a) full-precision rollout + learner (quant off), GRPO (token PPO clip 0.2/0.28)
  unaligned_tis  (b) b-bit W4A16-style rollout, full-precision learner forward, token PPO + token TIS (C = 2)
  qarl_grpo      (c) QaRL: the learner's forward on the rollout's b-bit weights, GRPO (token PPO)
  qarl_tbpo      (d) QaRL + TBPO (the default loss of configs/cpu_default.yaml)
  unaligned_tis_r3, qarl_tbpo_r3   (b), (d) with rollout routing replay (R3: algo.routing_replay); they also
                 report how often the learner, routing on its own, agrees with the server (routing/agree_token)
  qarl_grpo_exact, qarl_tbpo_exact (c), (d) with ``numerics=exact`` (docs/numerics.md): the learner's log-probs
                 equal the sampler's bit for bit, so plain on-policy GRPO has no mismatch left to correct
plus shuffled-reward controls (``reward.shuffle=true``: each group's rewards in a random order) of the
cells named by --controls. A seed S sets both the run seed and the training-data seed.

The servers compute in fp32 unless --rollout-dtype bfloat16 (pinned either way, whatever the configs say):
with fp32 the aligned learner (fp32) matches the sampler to ~1e-7 per token, so the mismatch that remains
in the unaligned arm is quantization's alone; bf16 serving is ~4x faster at rollout here but adds an
activation-rounding mismatch of a few 1e-3 per token to every arm, quantized or not (measured: 2-bit
aligned run, 2 steps: 1.8e-7 with fp32, 2.9e-3 to 4.4e-3 with bf16; rollout 4.2 s vs 1.05 s per step).

Each cell and seed is one ``qarl train --config configs/cpu_default.yaml`` subprocess (launch.backend=local)
with the arm's overrides, in its own directory ``<out>/<cell>/seed<S>``; a finished one (summary.json and
the last step's evaluation present, same overrides) is skipped, so an interrupted study resumes where it
stopped. An unfinished one is started again from scratch. Then every finished cell is aggregated into
the report (--doc, default docs/REPRODUCTION.md; --smoke: <out>/REPRODUCTION.md) with plots next to it:
a table (start / final / best held-out greedy accuracy mean +- sd [min, max] over seeds, learner-vs-sampler
token mismatch, masked fractions, error-token rate, step time, rollout tokens/s), automatic comparisons
that never call a difference smaller than the spread between seeds, and accuracy / mismatch curves and
the histogram of the token log-ratio logp_old - logp_sampler per arm (the paper's Figure 4), from the
runs' ``train.save_log_ratios`` output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = "configs/cpu_default.yaml"
TOKEN_PPO = ["algo.loss.mode=token_ppo", "algo.loss.eps_low=0.2", "algo.loss.eps_high=0.28"]


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    quantized: bool
    overrides: tuple[str, ...]


ARMS: dict[str, Arm] = {a.name: a for a in [
    Arm("fp", "(a) full-precision rollout + learner, GRPO", False,
        ("quant.scheme=bf16", "learner.aligned=true", *TOKEN_PPO, "algo.loss.mismatch=none")),
    Arm("unaligned_tis", "(b) low-bit rollout + full-precision learner, token PPO + TIS", True,
        ("quant.scheme=w4a16", "learner.aligned=false", *TOKEN_PPO, "algo.loss.mismatch=tis_token",
         "algo.loss.tis_cap=2.0")),
    Arm("qarl_grpo", "(c) QaRL: aligned low-bit learner + rollout, GRPO", True,
        ("quant.scheme=w4a16", "learner.aligned=true", *TOKEN_PPO, "algo.loss.mismatch=none")),
    Arm("qarl_tbpo", "(d) QaRL + TBPO", True,
        ("quant.scheme=w4a16", "learner.aligned=true", "algo.loss.mode=tbpo")),
    Arm("unaligned_tis_r3", "(b + R3) arm (b), the learner replaying the rollout's routes", True,
        ("quant.scheme=w4a16", "learner.aligned=false", *TOKEN_PPO, "algo.loss.mismatch=tis_token",
         "algo.loss.tis_cap=2.0", "algo.routing_replay=true")),
    Arm("qarl_tbpo_r3", "(d + R3) QaRL + TBPO, the learner replaying the rollout's routes", True,
        ("quant.scheme=w4a16", "learner.aligned=true", "algo.loss.mode=tbpo", "algo.routing_replay=true")),
    Arm("qarl_grpo_exact", "(c, exact) QaRL with exact numerics (mismatch 0), plain on-policy GRPO", True,
        ("quant.scheme=w4a16", "learner.aligned=true", *TOKEN_PPO, "algo.loss.mismatch=none", "numerics=exact")),
    Arm("qarl_tbpo_exact", "(d, exact) QaRL + TBPO with exact numerics (mismatch 0)", True,
        ("quant.scheme=w4a16", "learner.aligned=true", "algo.loss.mode=tbpo", "numerics=exact")),
]}  # fmt: skip


PAPER_ARMS = ("fp", "unaligned_tis", "qarl_grpo", "qarl_tbpo")  # the default study; the R3 arms on request


@dataclass(frozen=True)
class Cell:
    """One arm at one bit width (None for the full-precision arm), with true or shuffled rewards."""

    arm: str
    bits: int | None
    shuffled: bool = False

    @property
    def name(self) -> str:
        return self.arm + (f"_w{self.bits}" if self.bits else "") + ("_shuffled" if self.shuffled else "")

    @property
    def label(self) -> str:
        bits = f" at {self.bits} bits" if self.bits else ""
        return ARMS[self.arm].label + bits + (", shuffled rewards" if self.shuffled else "")

    def overrides(self) -> list[str]:
        out = list(ARMS[self.arm].overrides)
        if self.bits:
            out.append(f"quant.num_bits={self.bits}")
        if self.shuffled:
            out.append("reward.shuffle=true")
        return out


@dataclass(frozen=True)
class Setting:
    steps: int
    seeds: tuple[int, ...]
    bits: tuple[int, ...]
    arms: tuple[str, ...]
    controls: tuple[Cell, ...]
    eval_every: int
    eval_n: int
    extra: tuple[str, ...]  # key.sub=value overrides of the command line, applied to every cell last
    rollout_dtype: str = "float32"

    def cells(self) -> list[Cell]:
        cells = []
        for arm in self.arms:
            cells += [Cell(arm, None)] if not ARMS[arm].quantized else [Cell(arm, b) for b in self.bits]
        return cells + [c for c in self.controls if c not in cells]

    def common(self, seed: int) -> list[str]:
        return ["launch.backend=local", f"train.steps={self.steps}", f"train.eval.every={self.eval_every}",
                f"train.eval.n={self.eval_n}", "train.eval.sampled_n=0", "train.checkpoint.every=0",
                "train.checkpoint.keep=1", "train.save_log_ratios=true", f"rollout.dtype={self.rollout_dtype}",
                f"seed={seed}", f"data.synthetic.seed={seed}"]  # fmt: skip

    def cell_overrides(self, cell: Cell, seed: int, out_dir: Path) -> list[str]:
        return [*self.common(seed), *cell.overrides(), *self.extra, f"train.output_dir={out_dir}"]


def parse_control(text: str) -> Cell:
    """``fp`` or ``qarl_tbpo@2``: the cell whose shuffled-reward control is run."""
    arm, _, bits = text.partition("@")
    if arm not in ARMS:
        raise SystemExit(f"--controls: unknown arm {arm!r}; arms: {', '.join(ARMS)}")
    if ARMS[arm].quantized != bool(bits):
        raise SystemExit(f"--controls: {text!r}: " + ("give a bit width, e.g. {arm}@2" if ARMS[arm].quantized
                                                       else f"arm {arm} has no bit width"))
    return Cell(arm, int(bits) if bits else None, shuffled=True)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


# ------------------------------------------------------------------------------------------------ running
def train_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_qarl.cli", "train", "--config", BASE_CONFIG, "--no-progress", *overrides]


def shown_command(overrides: list[str]) -> str:
    return shlex.join([".venv/bin/qarl", "train", "--config", BASE_CONFIG, *overrides])


def is_finished(run_dir: Path, steps: int) -> bool:
    """summary.json written (the run ended normally) and the last step's held-out evaluation logged."""
    metrics = run_dir / "metrics.jsonl"
    if not (run_dir / "summary.json").is_file() or not metrics.is_file():
        return False
    rows = _read_jsonl(metrics)
    return any(r.get("step") == steps and "eval/greedy_accuracy" in r for r in rows)


def run_cell(setting: Setting, cell: Cell, seed: int, out: Path, keep_checkpoints: bool, timeout_s: float,
             log=print) -> str:
    """Run one cell and seed unless finished; returns 'done', 'ran' or 'failed: <why>'."""
    run_dir = out / cell.name / f"seed{seed}"
    overrides = setting.cell_overrides(cell, seed, run_dir)
    marker = run_dir / "repro_cell.json"
    record = {"cell": cell.name, "arm": cell.arm, "bits": cell.bits, "shuffled": cell.shuffled, "label": cell.label,
              "seed": seed, "config": BASE_CONFIG, "overrides": overrides}
    if marker.is_file():
        old = json.loads(marker.read_text())
        if old.get("overrides") != overrides:
            raise SystemExit(f"{run_dir}: holds a run with other settings ({shlex.join(old.get('overrides', []))});"
                             " choose another --out or remove that directory")
        if is_finished(run_dir, setting.steps):
            return "done"
        log(f"{cell.name} seed {seed}: unfinished earlier run, starting it again")
        shutil.rmtree(run_dir)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise SystemExit(f"{run_dir}: exists but was not made by this script; choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    record["load_at_start"] = os.getloadavg()[0]
    marker.write_text(json.dumps(record, indent=1) + "\n")
    log(f"{cell.name} seed {seed}: {shown_command(overrides)}")
    started = time.perf_counter()
    with open(run_dir / "train.log", "w") as f:
        try:
            rc = subprocess.run(train_command(overrides), stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - started
    if rc != 0 or not is_finished(run_dir, setting.steps):
        tail = (run_dir / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
        return f"failed: exit {rc} after {wall:.0f} s ({' | '.join(tail)})"
    record["wall_s"] = wall
    marker.write_text(json.dumps(record, indent=1) + "\n")
    if not keep_checkpoints:  # the tiny model's shards + Adam state; the metrics are what the report uses
        for d in ("checkpoints", "rollout_init"):
            shutil.rmtree(run_dir / d, ignore_errors=True)
    log(f"{cell.name} seed {seed}: finished in {wall:.0f} s")
    return "ran"


# -------------------------------------------------------------------------------------------- aggregation
def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def override_value(overrides: list[str], key: str) -> str | None:
    """The last ``key=value`` of ``overrides`` (as qarl train applies them), or None."""
    vals = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key]
    return vals[-1] if vals else None


@dataclass
class SeedRun:
    seed: int
    rows: list[dict]
    wall_s: float | None
    log_ratio_files: list[Path]
    overrides: list[str]
    load_at_start: float | None = None

    def evals(self) -> list[tuple[int, float]]:
        return [(r["step"], r["eval/greedy_accuracy"]) for r in self.rows
                if _num(r.get("eval/greedy_accuracy")) is not None]  # fmt: skip

    def step_rows(self) -> list[dict]:
        return [r for r in self.rows if "time/step_s" in r]

    def step_mean(self, key: str, skip_first: bool = False) -> float | None:
        rows = self.step_rows()[1:] if skip_first and len(self.step_rows()) > 1 else self.step_rows()
        return _mean(_num(r.get(key)) for r in rows)

    def summary(self) -> dict[str, float | None]:
        ev = self.evals()
        later = [a for s, a in ev if s > 0]
        evals = [r for r in self.rows if "time/eval_s" in r]
        return {
            "start_acc": next((a for s, a in ev if s == 0), None),
            "final_acc": ev[-1][1] if ev and ev[-1][0] > 0 else None,
            "best_acc": max(later) if later else None,
            "mismatch_mean": self.step_mean("mismatch/mismatch_tok_abs_mean"),
            "mismatch_p99": self.step_mean("mismatch/mismatch_tok_abs_p99"),
            "mismatch_free": self.step_mean("routing/mismatch_free_tok_abs_mean"),  # R3 arms: without replay
            "agree_token": self.step_mean("routing/agree_token"),
            "band_masked": self.step_mean("loss/band_masked_frac"),
            "clip_frac": self.step_mean("loss/clip_frac"),
            "tis_truncated": self.step_mean("loss/tis_truncated_frac"),
            "err_low_prob": self.step_mean("error_tokens/err_low_prob_frac"),
            "err_repeat": self.step_mean("error_tokens/err_repeat_rate"),
            "reward": self.step_mean("reward/mean"),
            "step_s": self.step_mean("time/step_s", skip_first=True),
            "rollout_tok_s": self.step_mean("throughput/rollout_tokens_per_s", skip_first=True),
            "eval_s": _mean(_num(r.get("time/eval_s")) for r in evals),
            "wall_s": self.wall_s,
        }


def _load_run(d: Path) -> SeedRun:
    marker = json.loads((d / "repro_cell.json").read_text())
    return SeedRun(marker["seed"], _read_jsonl(d / "metrics.jsonl"), marker.get("wall_s"),
                   sorted((d / "log_ratios").glob("step_*.npy")), marker["overrides"], marker.get("load_at_start"))


def collect(out: Path, setting: Setting) -> dict[Cell, list[SeedRun]]:
    """Finished runs of the setting's cells and seeds (unfinished or missing ones are left out)."""
    found: dict[Cell, list[SeedRun]] = {}
    for cell in setting.cells():
        runs = [_load_run(out / cell.name / f"seed{seed}") for seed in setting.seeds
                if is_finished(out / cell.name / f"seed{seed}", setting.steps)]
        if runs:
            found[cell] = runs
    return found


def collect_any(study: Path) -> dict[Cell, list[SeedRun]]:
    """Every finished run this script made under ``study``, whatever its setting (for --timings-from)."""
    found: dict[Cell, list[SeedRun]] = {}
    for marker in sorted(study.glob("*/seed*/repro_cell.json")):
        rec = json.loads(marker.read_text())
        if is_finished(marker.parent, int(override_value(rec["overrides"], "train.steps"))):
            found.setdefault(Cell(rec["arm"], rec["bits"], rec["shuffled"]), []).append(_load_run(marker.parent))
    return found


@dataclass(frozen=True)
class Stat:
    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n

    @property
    def sd(self) -> float:
        if self.n < 2:
            return float("nan")
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (self.n - 1))

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)


def stat(runs: list[SeedRun], key: str) -> Stat | None:
    vals = tuple(v for v in (r.summary()[key] for r in runs) if v is not None)
    return Stat(vals) if vals else None


def fmt_acc(s: Stat | None) -> str:
    if s is None:
        return "-"
    if s.n == 1:
        return f"{100 * s.mean:.1f}"
    return f"{100 * s.mean:.1f} ± {100 * s.sd:.1f} [{100 * s.lo:.1f}, {100 * s.hi:.1f}]"




def verdict(name_a: str, a: Stat | None, name_b: str, b: Stat | None) -> str | None:
    """Compare two cells' accuracies. A difference is called only when it exceeds the spread between seeds:
    |difference of the means| > the larger of the two cells' seed ranges (max - min), and the ranges do not
    overlap. Anything else is reported as within the spread, with the numbers."""
    if a is None or b is None:
        return None
    diff = 100 * (a.mean - b.mean)
    head = f"{100 * a.mean:.1f} vs {100 * b.mean:.1f}, Δ {diff:+.1f}"
    if a.n < 2 or b.n < 2:
        return f"{head}: fewer than 2 seeds, no spread measured, no difference claimed"
    spread = 100 * max(a.hi - a.lo, b.hi - b.lo)
    apart = a.lo > b.hi or b.lo > a.hi
    if apart and abs(diff) > spread:
        better = name_a if a.mean > b.mean else name_b
        return f"{head} > seed spread {spread:.1f}, ranges apart: **{better} higher**"
    return (f"{head} within the seed spread {spread:.1f} (ranges {'apart' if apart else 'overlap'}): "
            "no difference claimed")


def comparisons(found: dict[Cell, list[SeedRun]], setting: Setting) -> list[str]:
    """A table: every pair of cells at each bit width (the fp arm in every block), and each control."""
    pairs: list[tuple[str, Cell, Cell]] = []
    fp = next((c for c in found if c.arm == "fp" and not c.shuffled), None)
    for bits in setting.bits:
        cells = ([fp] if fp is not None else []) + [c for c in found if c.bits == bits and not c.shuffled]
        pairs += [(str(bits), a, b) for i, a in enumerate(cells) for b in cells[i + 1:]]
    for ctl in (c for c in found if c.shuffled):
        if (real := Cell(ctl.arm, ctl.bits)) in found:
            pairs.append(("control", real, ctl))
    rows = []
    for bits, a, b in pairs:
        final = verdict(a.name, stat(found[a], "final_acc"), b.name, stat(found[b], "final_acc"))
        best = verdict(a.name, stat(found[a], "best_acc"), b.name, stat(found[b], "best_acc"))
        if final or best:
            rows.append(f"| {bits} | `{a.name}` vs `{b.name}` | {final or '-'} | {best or '-'} |")
    if not rows:
        return []
    return ["| bits | cells | final accuracy % | best accuracy % |", "|---|---|---|---|", *rows]


def mismatch_lines(found: dict[Cell, list[SeedRun]], setting: Setting) -> list[str]:
    """Aligned arms' mean token mismatch against the unaligned arm's, with the 100x criterion of issue 8."""
    lines = []
    fp = found.get(Cell("fp", None))
    fp_s = stat(fp, "mismatch_mean") if fp else None
    for bits in setting.bits:
        un = found.get(Cell("unaligned_tis", bits))
        un_s = stat(un, "mismatch_mean") if un else None
        if un_s is None:
            continue
        for arm in ("qarl_grpo", "qarl_tbpo"):
            al = found.get(Cell(arm, bits))
            al_s = stat(al, "mismatch_mean") if al else None
            if al_s is None:
                continue
            factor = un_s.mean / al_s.mean if al_s.mean > 0 else float("inf")
            verdict = "at least 100x: yes" if factor >= 100 else "LESS than 100x"
            if factor < 100 and fp_s is not None:
                verdict += (f"; the aligned arm is at {al_s.mean / fp_s.mean:.2g}x the full-precision arm's "
                            f"{fp_s.mean:.3g}, which has no quantization at all: that floor is the server computing "
                            f"in rollout.dtype={setting.rollout_dtype} against the fp32 learner, not quantization")
            lines.append(f"- {bits} bits: unaligned_tis {un_s.mean:.3g} vs {arm} {al_s.mean:.3g} mean |logp_old - "
                         f"logp_sampler| per token: alignment shrinks it {factor:.3g}x ({verdict})")
    if fp_s is not None:
        floor = ("fp32 learner vs fp32 server kernels, summed in different orders" if setting.rollout_dtype ==
                 "float32" else f"fp32 learner vs a {setting.rollout_dtype} server")
        lines.append(f"- full precision (arm a, no quantization): {fp_s.mean:.3g}, the floor ({floor})")
    return lines


def fmt_mean(pattern: str = "{:.3g}"):
    return lambda s: "-" if s is None else pattern.format(s.mean)


TABLE_COLUMNS = [
    ("start_acc", "start acc %", lambda s: "-" if s is None else f"{100 * s.mean:.1f}"),
    ("final_acc", "final acc %", fmt_acc),
    ("best_acc", "best acc %", fmt_acc), ("mismatch_mean", "mean \\|Δlogp\\| / token", fmt_mean()),
    ("mismatch_p99", "p99 \\|Δlogp\\|", fmt_mean()),
    ("mismatch_free", "mean \\|Δlogp\\| without replay", fmt_mean()),
    ("agree_token", "routing agreement without replay", fmt_mean()), ("band_masked", "TBPO-band masked", fmt_mean()),
    ("clip_frac", "clip frac", fmt_mean()), ("tis_truncated", "TIS truncated", fmt_mean()),
    ("err_low_prob", "error-token rate", fmt_mean()), ("err_repeat", "repeat rate", fmt_mean()),
    ("step_s", "step s", fmt_mean("{:.2f}")), ("rollout_tok_s", "rollout tok/s", fmt_mean("{:.0f}")),
]  # fmt: skip


def table(found: dict[Cell, list[SeedRun]]) -> list[str]:
    head = ["cell", "seeds", *(h for _, h, _ in TABLE_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(found, key=lambda c: (c.shuffled, -(c.bits or 99), list(ARMS).index(c.arm)))
    for cell in order:
        runs = found[cell]
        cols = [f"`{cell.name}`", ",".join(str(r.seed) for r in runs)]
        cols += [f(stat(runs, key)) for key, _, f in TABLE_COLUMNS]
        lines.append("| " + " | ".join(cols) + " |")
    return lines


# ------------------------------------------------------------------------------------------------- plots
def _colors() -> dict[str, str]:
    """A colour per arm (every arm of ARMS: tests/test_repro_mini.py)."""
    return {"fp": "0.45", "unaligned_tis": "tab:red", "qarl_grpo": "tab:blue", "qarl_tbpo": "tab:green",
            "unaligned_tis_r3": "tab:orange", "qarl_tbpo_r3": "tab:olive", "qarl_grpo_exact": "tab:purple",
            "qarl_tbpo_exact": "tab:cyan"}


def plot_curves(found: dict[Cell, list[SeedRun]], setting: Setting, png: Path, key: str, ylabel: str,
                log_y: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits = list(setting.bits)
    fig, axes = plt.subplots(1, len(bits), figsize=(5 * len(bits), 3.6), squeeze=False, sharey=True)
    colors = _colors()
    for ax, b in zip(axes[0], bits, strict=True):
        for cell, runs in found.items():
            if cell.bits not in (b, None):
                continue
            series: dict[int, list[float]] = {}
            for r in runs:
                for row in r.rows:
                    v = _num(row.get(key))
                    if v is not None and (log_y is False or v > 0):
                        series.setdefault(row["step"], []).append(v)
            if not series:
                continue
            steps = sorted(series)
            mean = [sum(series[s]) / len(series[s]) for s in steps]
            ls = "--" if cell.shuffled else "-"
            ax.plot(steps, mean, ls, color=colors[cell.arm], marker="." if len(steps) < 40 else None,
                    label=f"{cell.name} (n={len(runs)})")
            if len(runs) > 1:
                ax.fill_between(steps, [min(series[s]) for s in steps], [max(series[s]) for s in steps],
                                color=colors[cell.arm], alpha=0.15)
        ax.set_title(f"{b}-bit weights (fp arm: full precision)")
        ax.set_xlabel("step")
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def load_log_ratios(runs: list[SeedRun]):
    import numpy as np

    parts = [np.load(f) for r in runs for f in r.log_ratio_files]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def plot_log_ratio_hist(found: dict[Cell, list[SeedRun]], setting: Setting, png: Path) -> dict[Cell, dict]:
    """Per bit width: the token log-ratio logp_old - logp_sampler of every training token of every seed, per arm
    (signed, clipped to +-2, log density) and its magnitude log10 |ratio| (exact zeros at the left edge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bits = list(setting.bits)
    fig, axes = plt.subplots(2, len(bits), figsize=(5 * len(bits), 7), squeeze=False)
    colors = _colors()
    stats: dict[Cell, dict] = {}
    lin_bins = np.linspace(-2, 2, 161)
    mag_bins = np.linspace(-12, 1, 131)
    for j, b in enumerate(bits):
        for cell, runs in found.items():
            if cell.shuffled or cell.bits not in (b, None):
                continue
            r = load_log_ratios(runs)
            if r.size == 0:
                continue
            stats[cell] = {"tokens": int(r.size), "abs_mean": float(np.abs(r).mean()),
                           "abs_p99": float(np.quantile(np.abs(r), 0.99)), "exact_zero": float((r == 0).mean()),
                           "beyond_0.1": float((np.abs(r) > 0.1).mean())}  # fmt: skip
            kw = {"histtype": "step", "color": colors[cell.arm], "label": f"{cell.name} ({r.size} tokens)"}
            axes[0][j].hist(np.clip(r, -2, 2), bins=lin_bins, density=True, **kw)
            axes[1][j].hist(np.log10(np.maximum(np.abs(r), 1e-12)), bins=mag_bins, density=True, **kw)
        axes[0][j].set_yscale("log")
        axes[0][j].set_title(f"{b}-bit: logp_old - logp_sampler (clipped to ±2)")
        axes[1][j].set_title(f"{b}-bit: log10 |logp_old - logp_sampler| (0 -> -12)")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return stats


# ------------------------------------------------------------------------------------------------ report
def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def write_report(found: dict[Cell, list[SeedRun]], setting: Setting, doc: Path, command: str, smoke: bool,
                 failures: list[str]) -> None:
    plots = doc.parent / "repro"
    plots.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(plots, doc.parent)
    hist_stats = {}
    if found:
        plot_curves(found, setting, plots / "accuracy.png", "eval/greedy_accuracy", "held-out greedy accuracy")
        plot_curves(found, setting, plots / "mismatch.png", "mismatch/mismatch_tok_abs_mean",
                    "mean |logp_old - logp_sampler| per token", log_y=True)
        hist_stats = plot_log_ratio_hist(found, setting, plots / "log_ratio_hist.png")
        if any(r.step_mean("routing/agree_token") is not None for runs in found.values() for r in runs):
            plot_curves(found, setting, plots / "routing_agreement.png", "routing/agree_token",
                        "tokens routed as the server did, without replay")
    loads = [r.load_at_start for runs in found.values() for r in runs if r.load_at_start is not None]
    load = f"{min(loads):.1f} to {max(loads):.1f}" if loads else "not recorded"
    expected = len(setting.cells()) * len(setting.seeds)
    got = sum(len(v) for v in found.values())
    L = [f"# Miniature reproduction: {'SMOKE RUN (not evidence)' if smoke else 'QaRL arms on the tiny Qwen3-MoE'}",
         ""]
    if smoke:
        L += ["> **Smoke setting**: one seed and a few steps, to check the pipeline end to end. The numbers below",
              "> show the format and the timings, not a result; nothing here supports a claim about the arms.", ""]
    L += ["Written by `benchmarks/repro_mini.py` from the runs' metrics; every figure is what the runs logged.", "",
          "Command:", "", "```bash", command, "```", "",
          f"- cells x seeds finished: {got} of {expected}; seeds {', '.join(map(str, setting.seeds))} (a seed sets "
          "`seed` and `data.synthetic.seed`, so every arm sees the same prompts)",
          f"- {setting.steps} steps per run; held-out greedy accuracy on {setting.eval_n} problems at the start, "
          + (f"every {setting.eval_every} steps " if setting.eval_every else "")
          + "and after the last step (through the rollout server: the low-bit arms are evaluated on the low-bit "
          "weights they serve)",
          f"- base config `{BASE_CONFIG}` (tiny Qwen3-MoE, 16 prompts x 8 samples, lr 1e-5, fp32 "
          "learner); common overrides: `" + " ".join(setting.common(0)[:9]) + " seed=S data.synthetic.seed=S`"
          + (f"; extra: `{' '.join(setting.extra)}`" if setting.extra else ""),
          f"- machine: {_machine()}; 1-minute load average when the runs started: {load} (a shared machine: "
          "step times and tokens/s are indicative); code at aggregation: " + _git_commit(), "",
          "| arm | overrides |", "|---|---|"]
    for arm in setting.arms:
        L.append(f"| {ARMS[arm].label} (`{arm}`) | `{' '.join(ARMS[arm].overrides)}`"
                 + (" `quant.num_bits=b`" if ARMS[arm].quantized else "") + " |")
    if setting.controls:
        L.append("| shuffled-reward control of " + ", ".join(f"`{c.name.removesuffix('_shuffled')}`"
                                                          for c in setting.controls) + " | `reward.shuffle=true` |")
    L += ["", "## Results", "",
          "Final / best accuracy in %: mean ± sd [min, max] over seeds; the other columns are means over seeds "
          "of each run's mean over its training steps: token mismatch "
          "`mismatch/mismatch_tok_abs_mean` / `_p99` (learner's logp_old vs the sampler's log-prob); "
          "`loss/band_masked_frac` (responses outside TBPO's bands; for the non-TBPO arms, what TBPO would "
          "mask), `loss/clip_frac`, `loss/tis_truncated_frac`; error-token rate = `error_tokens/err_low_prob_frac` "
          "(tokens the sampler gave p < 1e-3), repeat rate = `error_tokens/err_repeat_rate`; step time and "
          "rollout tokens/s without the first step.", ""]
    L += table(found) if found else ["(no finished runs)"]
    L += ["", "### Comparisons (automatic)", "",
          "A difference is called only when it exceeds the spread between seeds: the difference of the means is "
          "larger than the larger of the two cells' seed ranges (max - min) and the ranges do not overlap; "
          "otherwise it is reported as within the spread. With one seed nothing is called.", ""]
    L += comparisons(found, setting) or ["(nothing to compare)"]
    L += ["", "### Learner-sampler mismatch: aligned vs unaligned", ""]
    L += mismatch_lines(found, setting) or ["(needs the unaligned and an aligned arm at the same bit width)"]
    if hist_stats:
        L += ["", "Token log-ratio logp_old - logp_sampler pooled over every training token of every seed "
              "(train.save_log_ratios):", "",
              "| cell | tokens | mean \\|r\\| | p99 \\|r\\| | exactly 0 | \\|r\\| > 0.1 |", "|---|---|---|---|---|---|"]
        for cell, s in sorted(hist_stats.items(), key=lambda kv: kv[0].name):
            L.append(f"| `{cell.name}` | {s['tokens']} | {s['abs_mean']:.3g} | {s['abs_p99']:.3g} | "
                     f"{100 * s['exact_zero']:.1f}% | {100 * s['beyond_0.1']:.2f}% |")
    if found:
        L += ["", "## Plots", "",
              "Held-out greedy accuracy (mean over seeds, band = min..max; dashed = shuffled rewards):", "",
              f"![accuracy]({rel}/accuracy.png)", "", "Mean token mismatch per step (log scale):", "",
              f"![mismatch]({rel}/mismatch.png)", "",
              "Distribution of the token log-ratio between learner and sampler (the paper's Figure 4):", "",
              f"![log-ratio histogram]({rel}/log_ratio_hist.png)"]
        if (plots / "routing_agreement.png").is_file():
            L += ["", "Share of response tokens whose top-k experts the learner, routing on its own, picks as the "
                  "server did (all layers; R3 arms):", "", f"![routing agreement]({rel}/routing_agreement.png)"]
    walls = [r.wall_s for runs in found.values() for r in runs if r.wall_s]
    L += ["", "## Cost", "",
          f"- wall time of the runs in this report: {sum(walls) / 60:.1f} min over {len(walls)} runs "
          f"(mean {(_mean(walls) or 0):.0f} s per run)" if walls else "- wall times not recorded"]
    if failures:
        L += ["", "## Failed runs", "", *(f"- {f}" for f in failures)]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(L) + "\n")


# ---------------------------------------------------------------------------------------------- estimate
def estimate_seconds(setting: Setting, timings: dict[Cell, list[SeedRun]]) -> float:
    """Duration of ``setting`` from measured runs: per cell, startup + steps x step time + evals x eval time
    (eval time scaled by the number of held-out problems). Cells without a measurement use the mean."""
    per: dict[str, dict[str, float]] = {}
    for cell, runs in timings.items():
        for r in runs:
            s = r.summary()
            steps = [x["time/step_s"] for x in r.step_rows()]
            evals = [x for x in r.rows if "time/eval_s" in x]
            n_eval = int(override_value(r.overrides, "train.eval.n") or 200)
            if r.wall_s is None or not steps or s["eval_s"] is None:
                continue
            overhead = r.wall_s - sum(steps) - sum(x["time/eval_s"] for x in evals)
            d = per.setdefault(cell.name, {"n": 0, "overhead": 0.0, "step": 0.0, "eval_per_problem": 0.0})
            d["n"] += 1
            d["overhead"] += overhead
            d["step"] += sum(steps) / len(steps)
            d["eval_per_problem"] += s["eval_s"] / n_eval
    if not per:
        raise SystemExit("--timings-from: no finished runs with timings there")
    avg = {k: sum(d[k] / d["n"] for d in per.values()) / len(per) for k in ("overhead", "step", "eval_per_problem")}
    n_evals = 1 + (setting.steps // setting.eval_every if setting.eval_every else 0)
    n_evals += int(not setting.eval_every or setting.steps % setting.eval_every != 0)
    total = 0.0
    for cell in setting.cells():
        d = per.get(cell.name)
        m = {k: d[k] / d["n"] for k in avg} if d else avg
        total += len(setting.seeds) * (m["overhead"] + setting.steps * m["step"]
                                       + n_evals * setting.eval_n * m["eval_per_problem"])
    return total


# -------------------------------------------------------------------------------------------------- main
def build_setting(args: argparse.Namespace) -> Setting:
    if args.smoke:
        steps, seeds, eval_every, eval_n = 2, (1,), 0, 50
    else:
        steps, seeds, eval_every, eval_n = 40, (1, 2, 3), 10, 200
    steps = args.steps or steps
    seeds = _ints(args.seeds) if args.seeds else seeds
    eval_every = args.eval_every if args.eval_every is not None else eval_every
    eval_n = args.eval_n or eval_n
    bits = _ints(args.bits)
    for b in bits:
        if b not in (2, 3, 4):
            raise SystemExit(f"--bits: {b} is not one of 2, 3, 4")
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"--arms: unknown arm {a!r}; arms: {', '.join(ARMS)}")
    controls = tuple(parse_control(c.strip()) for c in args.controls.split(",") if c.strip())
    for c in controls:
        if c.bits is not None and c.bits not in bits:
            raise SystemExit(f"--controls: {c.arm}@{c.bits} is outside --bits {args.bits}")
    if not seeds or steps < 1:
        raise SystemExit("--seeds and --steps must be non-empty / positive")
    return Setting(steps, seeds, bits, arms, controls, eval_every, eval_n, tuple(args.overrides), args.rollout_dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--smoke", action="store_true", help="every cell, 1 seed, 2 steps, 50 held-out problems")
    p.add_argument("--steps", type=int, help="training steps per run (40; smoke 2)")
    p.add_argument("--seeds", help="comma-separated seeds (1,2,3; smoke 1)")
    p.add_argument("--bits", default="4,3,2", help="weight bit widths of the low-bit arms (4,3,2)")
    p.add_argument("--arms", default=",".join(PAPER_ARMS),
                   help=f"arms to run (default the paper's {','.join(PAPER_ARMS)}; all: {','.join(ARMS)})")
    p.add_argument("--controls", default="fp,qarl_tbpo@2",
                   help="cells whose shuffled-reward control is run: arm or arm@bits, comma-separated "
                        "(fp,qarl_tbpo@2; '' for none)")
    p.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (10; smoke 0 = start/end)")
    p.add_argument("--eval-n", type=int, help="held-out problems per evaluation (200; smoke 50)")
    p.add_argument("--rollout-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the servers' compute dtype (float32: the aligned learner matches the sampler to ~1e-7, "
                        "so the mismatch left is quantization's; bfloat16: ~4x faster rollouts, plus a bf16 "
                        "activation-rounding mismatch of a few 1e-3 per token in every arm)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="qarl train overrides for every run, as every command takes them")
    p.add_argument("--out", type=Path, help="runs directory (<repo>/runs/repro_mini; smoke .../repro_mini_smoke)")
    p.add_argument("--doc", type=Path, help="report (docs/REPRODUCTION.md; smoke <out>/REPRODUCTION.md)")
    p.add_argument("--aggregate-only", action="store_true", help="write the report from finished runs only")
    p.add_argument("--plan", action="store_true", help="list the runs (and estimate with --timings-from); run none")
    p.add_argument("--timings-from", type=Path, help="a finished study dir (e.g. the smoke's) to estimate from")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints/ and rollout_init/")
    p.add_argument("--run-timeout-s", type=float, default=3600.0, help="a run taking longer fails (3600)")
    args = p.parse_intermixed_args(argv)
    setting = build_setting(args)
    out = (args.out or REPO / "runs" / ("repro_mini_smoke" if args.smoke else "repro_mini")).resolve()
    doc = args.doc or (out / "REPRODUCTION.md" if args.smoke else REPO / "docs" / "REPRODUCTION.md")
    argv_shown = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--aggregate-only"]
    command = shlex.join([".venv/bin/python", "benchmarks/repro_mini.py", *argv_shown])
    cells = setting.cells()
    print(f"{len(cells)} cells x {len(setting.seeds)} seeds = {len(cells) * len(setting.seeds)} runs of "
          f"{setting.steps} steps -> {out}")
    if args.plan:
        for cell in cells:
            print(f"  {cell.name:28s} {cell.label}")
        print("  one run: " + shown_command(setting.cell_overrides(cells[0], setting.seeds[0],
                                                                   out / cells[0].name / f"seed{setting.seeds[0]}")))
        if args.timings_from:
            src = args.timings_from.resolve()
            secs = estimate_seconds(setting, collect_any(src))
            print(f"estimated duration: {secs / 3600:.1f} h ({secs / 60:.0f} min), from the runs in {src}")
        return 0
    failures = []
    if not args.aggregate_only:
        t0 = time.perf_counter()
        for seed in setting.seeds:  # seed-major: a partial study already has every cell at some seeds
            for cell in cells:
                status = run_cell(setting, cell, seed, out, args.keep_checkpoints, args.run_timeout_s)
                if status.startswith("failed"):
                    failures.append(f"{cell.name} seed {seed}: {status}")
                    print(failures[-1], file=sys.stderr)
        print(f"all runs: {(time.perf_counter() - t0) / 60:.1f} min")
    found = collect(out, setting)
    write_report(found, setting, doc, command, args.smoke, failures)
    print(f"report: {doc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
