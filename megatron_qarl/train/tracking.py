"""Where a run's numbers go: TensorBoard scalars (``<out>/tb``), one JSON line per step
(``<out>/metrics.jsonl``), a progress bar on the console, and plots of reward, accuracy and mismatch
(``<out>/plots.png``) when the run ends.

A resumed run starts at the checkpoint's step: later lines of metrics.jsonl are dropped and
TensorBoard's events after that step are purged, so the curves have no duplicates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm

PLOTTED = (("reward/mean", "eval/greedy_accuracy", "eval/sampled_accuracy"),
           ("mismatch/mismatch_tok_abs_mean", "mismatch/mismatch_tok_abs_p99"),
           ("time/rollout_s", "time/logp_s", "time/update_s", "time/sync_s"),
           # train.async runs only (panels without data are left out)
           ("staleness/token_mean", "staleness/token_frac_0", "staleness/token_frac_1", "staleness/token_frac_2"),
           ("mismatch_quant/mismatch_tok_abs_mean", "mismatch_stale/mismatch_tok_abs_mean"))


class Tracker:
    def __init__(self, out_dir: str | Path, *, start_step: int = 0, total: int | None = None, progress: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out / "metrics.jsonl"
        if self.jsonl.exists():  # keep what the checkpoint covers
            kept = [line for line in self.jsonl.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
            self.jsonl.write_text("".join(line + "\n" for line in kept))
        self.writer = SummaryWriter(str(self.out / "tb"), purge_step=start_step + 1 if start_step else None)
        self.bar = tqdm(total=total, initial=start_step, desc="qarl train", unit="step", disable=not progress,
                        dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], jsonl: bool = True) -> None:
        """Scalars to TensorBoard and (``jsonl``) one line of metrics.jsonl for the step."""
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()
        if not jsonl:
            return
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v))
                                                 for k, v in metrics.items()}}) + "\n")
        if "time/step_s" in metrics:
            self.bar.update(1)
        shown = {"reward": "reward/mean", "greedy": "eval/greedy_accuracy", "mis": "mismatch/mismatch_tok_abs_mean",
                 "s": "time/step_s"}
        post = {k: f"{metrics[v]:.3g}" for k, v in shown.items() if v in metrics}
        if post and not self.bar.disable:
            self.bar.set_postfix(post, refresh=True)
        elif post:  # no terminal (a batch job's log): one line per step
            print(f"step {step}/{self.bar.total} " + " ".join(f"{k}={v}" for k, v in post.items()), flush=True)

    def histogram(self, step: int, name: str, values: list[float]) -> None:
        """A TensorBoard histogram (e.g. the per-token staleness of an asynchronous run's step)."""
        import numpy as np

        self.writer.add_histogram(name, np.asarray(values, dtype=np.float64), step)
        self.writer.flush()

    def console(self, message: str) -> None:
        self.bar.write(message)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        try:
            plot_metrics(self.jsonl, self.out / "plots.png")
        except Exception as err:  # noqa: BLE001 - a plot must never fail a finished run
            print(f"plots: {err}")


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(jsonl: str | Path, png: str | Path) -> None:
    """One panel per group of PLOTTED keys, each key against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl)
    panels = [keys for keys in PLOTTED if any(isinstance(r.get(k), (int, float)) for r in rows for k in keys)]
    panels = panels or list(PLOTTED[:1])
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, keys in zip(axes[0], panels, strict=True):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="." if len(pts) < 30 else None, label=key)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
