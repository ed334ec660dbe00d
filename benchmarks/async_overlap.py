"""Steps/hour of `qarl train` with train.async off, one_step and bounded(2) (bounded(1) and R3 on request),
learner and servers on their own cores, and a model of the speedup on a cluster from the measured phase times.

    .venv/bin/python benchmarks/async_overlap.py [--steps 8] [--learner-cores 0] [--server-cores 1]
        [--modes off one_step bounded(2) bounded(1) bounded(2)+R3] [--out benchmarks/results/async_overlap.md]

Each mode runs configs/cpu_default.yaml (launch.backend=local, no evaluation between the first and the last step,
no checkpoints before the end, train.mismatch_split off: it is a diagnostic, one extra prefill per sample) with
the trainer pinned to ``--learner-cores`` (``taskset``; its torch threads,
train.learner_threads, one per core) and the rollout server to ``--server-cores`` (rollout.launch_prefix =
taskset, rollout.threads one per core): overlap can only pay where the two do not share cores. Steps/hour is
3600 / the mean wall seconds of a step (time/step_s: every phase, the waits included) over the steps after the
first two (warm-up, and one_step's first step has nothing to overlap with).

The cluster model (``predicted_step_s``), stated as a model, not a measurement: with per-step phase times R
(rollout), W (reward), L (aligned log-probs, plus the servers' rescoring in async modes), U (update) and S (sync),
on a layout where learner and servers have their own GPUs,

    off       T = R + W + L + U + S
    one_step  T = max(R, W + L + U) + S            (step t+1's rollout runs during step t's W, L, U)
    bounded   T = max(R + P, W + L + U + S)        (the rollout never waits for the sync; P: one re-prefill
                                                    of the running requests per sync, the cost of retract)

and speedup = T_off / T_mode. Fed with the measured CPU phase times, and with the phase shares of a cluster
GRPO step (rollout 70% of the step, as verl's users report for GRPO; the other 30% split as our measured
W : L : U : S), it predicts the speedup at the 30B layouts (configs/qwen3-30b-a3b/*_2x8: 8 learner GPUs,
8 server GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"off": ["train.async=off"], "one_step": ["train.async=one_step"],
         "bounded(2)": ["train.async=bounded", "train.max_staleness=2"],
         "bounded(1)": ["train.async=bounded", "train.max_staleness=1"],
         "bounded(2)+R3": ["train.async=bounded", "train.max_staleness=2", "algo.routing_replay=true"],
         "bounded(1)+R3": ["train.async=bounded", "train.max_staleness=1", "algo.routing_replay=true"]}
DEFAULT_MODES = ("off", "one_step", "bounded(2)")
PHASES = ("rollout", "reward", "logp", "rescore", "update", "rollout_wait", "sync", "step")


def predicted_step_s(mode: str, R: float, W: float, L: float, U: float, S: float, P: float = 0.0) -> float:
    """The cluster model's step time (module docstring): off R+W+L+U+S; one_step max(R, W+L+U)+S;
    bounded max(R+P, W+L+U+S)."""
    if mode == "off":
        return R + W + L + U + S
    if mode == "one_step":
        return max(R, W + L + U) + S
    if mode.startswith("bounded"):
        return max(R + P, W + L + U + S)
    raise ValueError(f"mode {mode!r}")


def run(extra: list[str], steps: int, out: Path, learner_cores: str, server_cores: str) -> list[dict]:
    n_learner, n_server = len(learner_cores.split(",")), len(server_cores.split(","))
    taskset = shutil.which("taskset")
    if taskset is None:
        raise SystemExit("taskset not found (util-linux): it pins the learner and the servers to their cores")
    cmd = [taskset, "-c", learner_cores, sys.executable, "-m", "megatron_qarl.cli", "train", "--config",
           "configs/cpu_default.yaml", "--no-progress", f"train.output_dir={out}", f"train.steps={steps}",
           "launch.backend=local", "train.eval.every=0", "train.eval.n=8", "train.eval.sampled_n=0",
           "train.checkpoint.every=0", f"train.learner_threads={n_learner}", f"rollout.threads={n_server}",
           f"rollout.launch_prefix=[{taskset},-c,'{server_cores}']", "train.mismatch_split=false",
           "rollout.startup_timeout_s=1800", *extra]  # a server pinned to a busy core starts slowly
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}); see {log}:\n{log.read_text()[-3000:]}")
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "time/step_s" in r]


def mean(rows: list[dict], key: str) -> float:
    vals = [r.get(key, 0.0) for r in rows]
    return sum(vals) / max(len(vals), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--learner-cores", default="0")
    ap.add_argument("--server-cores", default="1")
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES),
                    help="off first (the ratios are against it); bounded(1), and each bounded with R3 "
                         "(algo.routing_replay: the sync pauses with abort and the requests continue), on request")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async_overlap.md"))
    args = ap.parse_args()
    if args.modes[0] != "off":
        raise SystemExit("--modes: off first (every ratio is against it)")
    if args.steps < 4:
        raise SystemExit("--steps: at least 4 (the first two are warm-up)")
    measured: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.modes:
            rows = run(MODES[name], args.steps, Path(tmp) / name.replace("(", "_").replace(")", ""), args.learner_cores,
                       args.server_cores)[2:]
            measured[name] = {p: mean(rows, f"time/{p}_s") for p in PHASES}
            measured[name]["regenerated"] = mean(rows, "async/regenerated")
            measured[name]["staleness"] = mean(rows, "staleness/token_mean")
            print(name, {k: round(v, 3) for k, v in measured[name].items()}, flush=True)
    off = measured["off"]
    lines = [f"# train.async: steps/hour, learner on cores {args.learner_cores}, server on cores {args.server_cores}",
             "", f"`python benchmarks/async_overlap.py --steps {args.steps}` on {platform.machine()}, "
             f"{os.cpu_count()} cores (`{platform.processor() or platform.platform()}`); configs/cpu_default.yaml, "
             "launch.backend=local, bf16 servers; mean over steps 3..N; modes one after another.", "",
             "| mode | step s | steps/hour | vs off | rollout wait s | reward s | logp s | rescore s | update s | "
             "wait before sync s | sync s | token staleness | regenerated/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in measured.items():
        lines.append(f"| {name} | {m['step']:.2f} | {3600 / m['step']:.0f} | {off['step'] / m['step']:.2f}x | "
                     f"{m['rollout']:.2f} | {m['reward']:.2f} | {m['logp']:.2f} | {m['rescore']:.2f} | "
                     f"{m['update']:.2f} | {m['rollout_wait']:.2f} | {m['sync']:.2f} | {m['staleness']:.2f} | "
                     f"{m['regenerated']:.1f} |")
    R, W, L, U, S = off["rollout"], off["reward"], off["logp"], off["update"], off["sync"]
    rescore = 0.0  # train.mismatch_split off here (its cost: time/rescore_s of a run with it on)
    lines += ["", "## Cluster model (a model, not a measurement; benchmarks/async_overlap.py docstring)", "",
              "| phase times from | off s | one_step s | bounded(2) s | one_step speedup | bounded speedup |",
              "|---|---|---|---|---|---|"]
    rest = W + L + U + S

    def row(label: str, R: float, W: float, L: float, U: float, S: float, rescore: float) -> str:
        t = {m: predicted_step_s(m, R, W, L + rescore * (m != "off"), U, S) for m in ("off", "one_step", "bounded")}
        return (f"| {label} | {t['off']:.2f} | {t['one_step']:.2f} | {t['bounded']:.2f} | "
                f"{t['off'] / t['one_step']:.2f}x | {t['off'] / t['bounded']:.2f}x |")

    lines.append(row("this machine's off run (R, W, L, U, S measured)", R, W, L, U, S, rescore))
    if rest > 0:  # rollout 70% of the step; the rest in our measured proportions
        k = (0.3 / 0.7) * R / rest
        lines.append(row("30B layouts: rollout 70% of the off step (verl's GRPO report), W:L:U:S in our measured "
                         "proportions", R, W * k, L * k, U * k, S * k, rescore * k))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
