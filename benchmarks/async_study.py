"""Does an asynchronous mode learn as well as the sequential loop? 100-step runs per mode and seed, then the table.

    python benchmarks/async_study.py run   [--modes off bounded2 ...] [--seeds 1234 1235 1236] [--parallel 2]
    python benchmarks/async_study.py table [--out docs-table.md] [--plot curves.png]

``run``: each (mode, seed) as ``qarl train --config configs/cpu_default.yaml seed=S launch.backend=local
train.learner_threads=1 rollout.threads=1 <the mode's keys>`` (the protocol of docs/training.md's one_step study: one
torch thread per process, two runs at a time on a 2-core machine) into ``<root>/<mode>_<seed>``; a run with a
``done`` marker is skipped, so an interrupted study resumes. Modes (``MODES``) name their keys: off, one_step,
bounded2 / bounded1 (train.async=bounded, max_staleness 2 / 1), and the same with ``_r3`` (algo.routing_replay).

``table``: from each run's metrics.jsonl, held-out greedy and sampled accuracy at steps 0 / 25 / 50 / 75 / 100 and
the greedy gain (step 100 - step 0) per run; per mode the mean gain, its difference from off's, the spread (max - min
gain); and what staleness each mode's samples had (the fraction of response tokens sampled 0, 1, 2 versions before
the weights they train, mean over steps) with the per-token mismatch split (quantization / staleness parts, mean of
|d| per step, averaged). ``--plot``: greedy accuracy against step, one line per run, coloured by mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "runs" / "async_study"
EVAL_STEPS = (0, 25, 50, 75, 100)
MODES = {
    "off": ["train.async=off"],
    "one_step": ["train.async=one_step"],
    "bounded2": ["train.async=bounded", "train.max_staleness=2"],
    "bounded1": ["train.async=bounded", "train.max_staleness=1"],
    "bounded2_r3": ["train.async=bounded", "train.max_staleness=2", "algo.routing_replay=true"],
    "bounded1_r3": ["train.async=bounded", "train.max_staleness=1", "algo.routing_replay=true"],
}
PROTOCOL = ["--config", "configs/cpu_default.yaml", "launch.backend=local", "train.learner_threads=1",
            "rollout.threads=1"]


def command(mode: str, seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_qarl.cli", "train", *PROTOCOL, f"seed={seed}", *MODES[mode],
            f"train.output_dir={out}"]


def _run_one(mode: str, seed: int, root: Path) -> str:
    out = root / f"{mode}_{seed}"
    if (out / "done").exists():
        return f"{out.name}: done before, skipped"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(root / f"{mode}_{seed}.log", "w") as log:
        rc = subprocess.run(command(mode, seed, out), cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc == 0:
        (out / "done").write_text(f"{time.time() - t0:.0f} s\n")
    return f"{out.name}: exit {rc} after {time.time() - t0:.0f} s"


def run(modes: list[str], seeds: list[int], parallel: int, root: Path) -> None:
    jobs = [(m, s) for m in modes for s in seeds]
    with ThreadPoolExecutor(parallel) as pool:
        for line in pool.map(lambda job: _run_one(*job, root), jobs):
            print(line, flush=True)


def load(run_dir: Path) -> dict:
    """Accuracy at the eval steps and the per-step staleness and mismatch means of one run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = {r["step"]: r for r in rows if "eval/greedy_accuracy" in r}
    steps = [r for r in rows if "loss/loss" in r]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steps if key in r]
        return statistics.fmean(vals) if vals else None

    return {"greedy": [evals.get(s, {}).get("eval/greedy_accuracy") for s in EVAL_STEPS],
            "sampled": [evals.get(s, {}).get("eval/sampled_accuracy") for s in EVAL_STEPS],
            "steps": len(steps),
            "stale": [mean(f"staleness/token_frac_{i}") for i in range(3)], "stale_mean": mean("staleness/token_mean"),
            "mis_quant": mean("mismatch_quant/mismatch_tok_abs_mean"),
            "mis_stale": mean("mismatch_stale/mismatch_tok_abs_mean"),
            "continued": mean("async/continued"), "regenerated": mean("async/regenerated"),
            "step_s": mean("time/step_s")}


def runs_of(root: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for d in sorted(root.glob("*_*")):
        mode, _, seed = d.name.rpartition("_")
        if d.is_dir() and mode in MODES and seed.isdigit() and (d / "metrics.jsonl").exists():
            out.setdefault(mode, {})[int(seed)] = load(d)
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _gain(r: dict) -> float | None:
    g = r["greedy"]
    return None if g[0] is None or g[-1] is None else 100 * (g[-1] - g[0])


def table(runs: dict[str, dict[int, dict]]) -> str:
    out = ["| mode | seed | greedy % at 0 / 25 / 50 / 75 / 100 | sampled % at 0 / 25 / 50 / 75 / 100 | greedy gain |",
           "|---|---|---|---|---|"]
    gains: dict[str, list[float]] = {}
    for mode in MODES:
        for seed, r in sorted(runs.get(mode, {}).items()):
            g = _gain(r)
            if g is not None:
                gains.setdefault(mode, []).append(g)
            out.append(f"| {mode} | {seed} | {' / '.join(map(_pct, r['greedy']))} | "
                       f"{' / '.join(map(_pct, r['sampled']))} | {'-' if g is None else f'{g:+.1f}'} |")
    off = statistics.fmean(gains["off"]) if gains.get("off") else None
    out += ["", "| mode | runs | mean greedy gain | vs off | spread of gains | mean sampled at 100 | token staleness "
                "0 / 1 / 2 (fraction) | mismatch per token: quantization / staleness | mean step s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for mode, gs in gains.items():
        rs = [r for r in runs[mode].values() if _gain(r) is not None]  # finished runs only
        m = statistics.fmean(gs)
        vs = "-" if off is None or mode == "off" else f"{m - off:+.1f}"
        stale = " / ".join(f"{statistics.fmean(r['stale'][i] for r in rs if r['stale'][i] is not None):.3f}"
                           if any(r["stale"][i] is not None for r in rs) else "-" for i in range(3))
        mq = [r["mis_quant"] for r in rs if r["mis_quant"] is not None]
        ms = [r["mis_stale"] for r in rs if r["mis_stale"] is not None]
        mis = f"{statistics.fmean(mq):.2e} / {statistics.fmean(ms):.2e}" if mq and ms else "-"
        sampled = statistics.fmean(r["sampled"][-1] for r in rs if r["sampled"][-1] is not None)
        step_s = statistics.fmean(r["step_s"] for r in rs if r["step_s"] is not None)
        out.append(f"| {mode} | {len(gs)} | {m:+.1f} | {vs} | {max(gs) - min(gs):.1f} | {100 * sampled:.1f} | "
                   f"{stale} | {mis} | {step_s:.2f} |")
    return "\n".join(out) + "\n"


def plot(runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = dict(zip(MODES, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for mode, by_seed in runs.items():
        for i, (_seed, r) in enumerate(sorted(by_seed.items())):
            pts = [(s, 100 * g) for s, g in zip(EVAL_STEPS, r["greedy"], strict=True) if g is not None]
            ax.plot(*zip(*pts, strict=True), marker="o", color=colours[mode], alpha=0.8,
                    label=mode if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("cpu_default, 100 steps: each run (seeds 1234-1236)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--modes", nargs="+", default=["off", "bounded2", "bounded1"], choices=list(MODES))
    r.add_argument("--seeds", nargs="+", type=int, default=[1234, 1235, 1236])
    r.add_argument("--parallel", type=int, default=2)
    t = sub.add_parser("table")
    t.add_argument("--out", type=Path, default=None)
    t.add_argument("--plot", type=Path, default=None)
    for p in (r, t):
        p.add_argument("--root", type=Path, default=ROOT, help=f"where the runs live ({ROOT.relative_to(REPO)})")
    args = parser.parse_args()
    if args.what == "run":
        run(args.modes, args.seeds, args.parallel, args.root)
        return
    runs = runs_of(args.root)
    text = table(runs)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
