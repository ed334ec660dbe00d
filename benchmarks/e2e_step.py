"""End-to-end `qarl train` step time with its phase breakdown, BF16 rollout vs W4A16 QaRL, in one run.

    .venv/bin/python benchmarks/e2e_step.py [--steps 12] [--out benchmarks/results/e2e_step.md]

Runs configs/cpu_bf16_rollout.yaml (quantization off) and configs/cpu_default.yaml (W4A16 QaRL + TBPO)
one after the other with the same seeds, launch.backend=local, no evaluation and no checkpoints between
the first and the last step, and reports the mean seconds per phase over the steps after the first
(warm-up) and the ratio W4A16 / BF16. Both configs serve with bf16 activations (their rollout.dtype).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reward", "logp", "update", "sync", "step")
RUNS = (("BF16 rollout + learner", "configs/cpu_bf16_rollout.yaml"),
        ("W4A16 QaRL (default)", "configs/cpu_default.yaml"))


def run(config: str, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_qarl.cli", "train", "--config", config, "--no-progress",
           "launch.backend=local", f"train.steps={steps}", "train.eval.every=0", "train.eval.n=16",
           "train.eval.sampled_n=0", "train.checkpoint.every=0", f"train.output_dir={out}"]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "e2e_step.md"))
    args = ap.parse_args()
    means = {}
    extra = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in RUNS:
            rows = run(config, args.steps, Path(tmp) / Path(config).stem)[1:]  # drop the warm-up step
            means[name] = {p: sum(r[f"time/{p}_s"] for r in rows) / len(rows) for p in PHASES}
            extra[name] = {k: sum(r[k] for r in rows) / len(rows) for k in
                           ("throughput/rollout_tokens_per_s", "sync/bytes", "mismatch/mismatch_tok_abs_mean")}
    (bf, bname), (q, qname) = ((means[n], n) for n, _ in RUNS)
    lines = [
        f"Command: .venv/bin/python benchmarks/e2e_step.py --steps {args.steps}", "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; tiny "
        f"Qwen3-MoE, 16 prompts x 8 samples, 48 new tokens, one learner rank + one embedded server; mean of "
        f"steps 2..{args.steps} of each run (step 1 is warm-up).", "",
        "| phase (s) | " + " | ".join(n for n, _ in RUNS) + " | W4A16 / BF16 |", "|---|---|---|---|",
    ]
    lines += [f"| {p} | {bf[p]:.3f} | {q[p]:.3f} | {q[p] / bf[p]:.2f}x |" for p in PHASES]
    for key, fmt in (("throughput/rollout_tokens_per_s", "{:.0f}"), ("sync/bytes", "{:.0f}"),
                     ("mismatch/mismatch_tok_abs_mean", "{:.2e}")):
        a, b = extra[bname][key], extra[qname][key]
        lines.append(f"| {key} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.2f}x |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
