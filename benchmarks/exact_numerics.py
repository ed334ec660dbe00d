"""The cost of ``numerics: exact``: decode tokens/s at batch 1 and 16 on the embedded engine, and the learner's step
time, exact vs default, each pair measured in this one run (docs/numerics.md, BENCHMARKS.md).

    .venv/bin/python benchmarks/exact_numerics.py [--out benchmarks/results/exact_numerics.md] [--slice]

The project's tiny Qwen3-MoE, W4A16 (the main job's scheme), bf16 server activations. Decode: the engine model's
forward (serve/model.py; the engine thread's scheduling is the same in both modes) for ``--steps`` decode steps
after an 8-token prefill of every row; tokens/s = rows x steps / seconds (median of ``--repeats``). Learner: one
train step (forward + backward + Adam) of the aligned TP1 Megatron learner on 128 rows x 64 tokens (the main
job's 16 prompts x 8 samples, prompt + 48 new tokens), median of ``--steps`` after one warm-up step. ``--slice``:
also batch-1 decode on benchmarks/decode.py's 30B-A3B slice, where the exact engine's float32 weights cost bytes
the tiny model does not show.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "checkpoints" / "tiny-qwen3-moe"


def decode_tokens_per_s(model_dir: str, numerics: str, rows: int, steps: int, repeats: int) -> float:
    from megatron_qarl.serve.model import Qwen3MoeEngineModel

    model = Qwen3MoeEngineModel.from_model_dir(model_dir, torch.bfloat16, rows, 128, numerics=numerics)
    tokens = torch.randint(3, 32, (rows, 8), generator=torch.Generator().manual_seed(0))
    slots = torch.arange(rows)
    times = []
    for _ in range(repeats):
        model.forward(tokens, slots, torch.arange(8)[None].expand(rows, 8))
        start = time.perf_counter()
        for t in range(8, 8 + steps):
            model.forward(tokens[:, :1], slots, torch.full((rows, 1), t))
        times.append(time.perf_counter() - start)
    return rows * steps / statistics.median(times)


def slice_decode_ms(steps: int = 16) -> dict[str, float]:
    """ms a token at batch 1, default vs exact, on benchmarks/decode.py's 30B-A3B slice (W4A16, random weights; best
    of two interleaved runs each): where the tiny model's figures stop holding (exact reads float32 weights)."""
    import gc

    import decode  # benchmarks/decode.py (this folder is on sys.path when the script runs): the slice

    from megatron_qarl.serve.model import Qwen3MoeEngineModel

    arch = decode.Qwen3MoeArch.from_hf_config(decode.CONFIG)
    sd = decode.random_state_dict(arch)
    tensors, qcfg = decode.export_state_dict(sd, decode.QuantConfig(scheme="w4a16"))
    del sd
    best: dict[str, float] = {}
    for numerics in ("default", "exact", "default", "exact"):
        model = Qwen3MoeEngineModel(arch, tensors, qcfg, torch.bfloat16, slots=1, max_seq_len=8 + 2 + steps,
                                    numerics=numerics)
        model.forward(torch.randint(4, arch.vocab_size, (1, 8)), torch.tensor([0]), torch.arange(8)[None])
        tok = torch.tensor([[5]])
        for p in range(8, 10):  # warm
            model.forward(tok, torch.tensor([0]), torch.tensor([[p]]))
        start = time.perf_counter()
        for p in range(10, 10 + steps):
            model.forward(tok, torch.tensor([0]), torch.tensor([[p]]))
        ms = (time.perf_counter() - start) / steps * 1e3
        best[numerics] = min(best.get(numerics, ms), ms)
        del model
        gc.collect()
    return best


def _learner_steps(numerics: str, steps: int) -> list[float]:
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.qat.config import QuantConfig

    arch = Qwen3MoeArch.from_model_dir(MODEL)
    init_parallel(tp=1, ep=1, seed=1)
    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme="w4a16"),
                      numerics=numerics, act_dtype=torch.bfloat16)
    learner.load_hf(str(MODEL))
    tokens = torch.randint(3, 32, (128, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(128, 63)
    mask[:, 15:] = 1
    out = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
        out.append(time.perf_counter() - start)
    return out[1:]


def learner_step_s(numerics: str, steps: int) -> float:
    from megatron_qarl.moe.parallelize import run_ranks

    return statistics.median(run_ranks(1, _learner_steps, numerics, steps)[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--learner-steps", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--slice", action="store_true",
                   help="also decode at benchmarks/decode.py's 30B-A3B slice, batch 1 (~2 min, ~19 GB of memory)")
    args = p.parse_args()
    from megatron_qarl.qat.export import quantize_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(quantize_checkpoint(MODEL, "w4a16", Path(tmp) / "w4a16"))
        rows = []
        for batch in (1, 16):
            got = {n: decode_tokens_per_s(model_dir, n, batch, args.steps, args.repeats) for n in ("default", "exact")}
            rows.append((f"decode tokens/s, batch {batch}", got["default"], got["exact"],
                         got["default"] / got["exact"]))
    step = {n: learner_step_s(n, args.learner_steps) for n in ("default", "exact")}
    rows.append(("learner step s (128 x 64 tokens)", step["default"], step["exact"], step["exact"] / step["default"]))
    if args.slice:
        ms = slice_decode_ms()
        rows.append(("30B-A3B slice decode ms/token, batch 1", ms["default"], ms["exact"], ms["exact"] / ms["default"]))
    lines = [f"# numerics: exact vs default ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads)", "", "| measure | default | exact | cost (x) |", "|---|---|---|---|"]
    lines += [f"| {name} | {a:.3g} | {b:.3g} | {c:.2f} |" for name, a, b, c in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
