"""The cost of rollout routing replay (R3) per step, measured in one run: learner time and bytes returned.

    .venv/bin/python benchmarks/r3_cost.py [--repeats 5] [--out benchmarks/results/r3_cost.md]

Per model (the project's tiny Qwen3-MoE, and benchmarks/qat_overhead.py's wide 2-layer model with hidden
2048 and 16 experts top-4), on one Megatron learner rank (TP1, W4A16 fake quant, aligned), a batch shaped
like a configs/cpu_default.yaml step (16 prompts x 8 samples, 64 tokens each) goes through:
  - ``plain``: the aligned log-prob forward and one train step, as without R3;
  - ``r3``: the same with routing replay: one more aligned forward that routes on its own (the trainer's
    routing/* metrics), the aligned forward replaying the server's routes, and the train step replaying them.
Reported: median seconds of each over ``--repeats`` interleaved repeats and their ratio, and the bytes a
server returns per token (layers x top-k x int32) and per step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def measure(arch, repeats: int, rows: int, seq: int) -> dict:
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.qat.config import QuantConfig

    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-6), quant=QuantConfig(scheme="w4a16"),
                      routing_replay=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (rows, seq), generator=gen)
    mask = torch.ones(rows, seq - 1)
    _, server_BSLK = learner.forward_routes(tokens)  # stands in for the server's routes

    def step(routes):
        extra = {} if routes is None else {"routes_BSLK": routes}
        learner.train_step(Batch(tokens, mask, extra), lambda lp, b: token_mean_nll(lp, b, mask.numel()))

    def plain() -> None:
        learner.forward_logprobs(tokens)
        step(None)

    def r3() -> None:
        learner.forward_routes(tokens)
        learner.forward_logprobs(tokens, server_BSLK)
        step(server_BSLK)

    times: dict[str, list[float]] = {"plain": [], "r3": []}
    plain()  # warm-up
    r3()
    for _ in range(repeats):
        for name, fn in (("plain", plain), ("r3", r3)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    per_token = arch.num_hidden_layers * arch.num_experts_per_tok * 4
    return {"plain_s": statistics.median(times["plain"]), "r3_s": statistics.median(times["r3"]),
            "bytes_per_token": per_token, "bytes_per_step": per_token * rows * (seq - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/r3_cost.md")
    args = ap.parse_args()

    from qat_overhead import wide_arch  # this folder is on sys.path when the script runs

    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel, run_ranks

    def body():
        init_parallel()
        out = {"tiny": measure(Qwen3MoeArch.from_model_dir(REPO / "checkpoints/tiny-qwen3-moe"), args.repeats,
                               args.rows, args.seq)}
        out["wide"] = measure(wide_arch(), args.repeats, max(args.rows // 8, 1), args.seq)
        return out

    res = run_ranks(1, body)[0]
    lines = [f"# R3 cost per step ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, median of {args.repeats})", "",
             "| model | batch | plain: aligned forward + train step (s) | R3: + own-routing forward, replayed "
             "forward + replayed train step (s) | ratio | bytes returned / token | bytes returned / step |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        rows = args.rows if name == "tiny" else max(args.rows // 8, 1)
        lines.append(f"| {name} | {rows} x {args.seq} | {r['plain_s']:.2f} | {r['r3_s']:.2f} | "
                     f"{r['r3_s'] / r['plain_s']:.2f}x | {r['bytes_per_token']} | {r['bytes_per_step']:,} |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
