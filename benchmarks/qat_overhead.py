"""Learner step time with fake quantization on vs off, per scheme, measured in one run.

    .venv/bin/python benchmarks/qat_overhead.py [--steps 8] [--out benchmarks/results/qat_overhead.md]

Two models: the project's tiny Qwen3-MoE (checkpoints/tiny-qwen3-moe) and a wider random one
(hidden 2048, expert FFN 768, 2 layers, 16 experts top-4, head dim 128, 16 heads / 4 KV groups,
vocab 4096). One step = forward + backward + Adam step on the Megatron learner (TP1, fp32 master
weights); with fake quant on (ModelOpt quant modules on the one quantizer, qat/modules.py), each step
re-quantizes every targeted weight once (the optimizer changed it) and runs the forward on the low-bit values
(and W8A8's quantized activations). The "compile_quantizer" row runs that W4A16 refresh torch.compile'd
(learner.compile_quantizer; its one-off compile happens in the warm-up step, not timed).
Reported: median seconds per step and the ratio to quantization off, all in this one process.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# (scheme, learner.compile_quantizer)
SCHEMES = [("bf16", False), ("w4a16", False), ("w4a16", True), ("w8a8_fp8", False), ("w8a8_int8", False)]


def wide_arch():
    from megatron_qarl.moe.model import Qwen3MoeArch

    return Qwen3MoeArch(vocab_size=4096, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=128, num_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=768, intermediate_size=6144, rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False,
                        attention_bias=False)


def time_steps(arch, scheme: str, batch: int, seq: int, steps: int, compiled: bool = False) -> list[float]:
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.qat.config import QuantConfig

    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme=scheme),
                      compile_quantizer=compiled)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq - 1)
        t0 = time.perf_counter()
        learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.numel()))
        times.append(time.perf_counter() - t0)
    return times[1:]


def run(steps: int) -> str:
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel, run_ranks

    def body():
        init_parallel()
        tiny = Qwen3MoeArch.from_model_dir(REPO / "checkpoints/tiny-qwen3-moe")
        models = [("tiny (1.8M params, hidden 128)", tiny, 16, 64),
                  ("wide (hidden 2048, FFN 768, 16 experts, 2 layers)", wide_arch(), 2, 64)]
        rows = []
        for label, arch, batch, seq in models:
            base = None
            for scheme, compiled in SCHEMES:
                med = statistics.median(time_steps(arch, scheme, batch, seq, steps, compiled))
                base = base or med
                name = "off" if scheme == "bf16" else scheme + (" (compile_quantizer)" if compiled else "")
                rows.append(f"| {label} | {batch}x{seq} | {name} | "
                            f"{med * 1e3:.1f} | {med / base:.2f}x |")
        return rows

    rows = run_ranks(1, body)[0]
    head = ["| model | batch x seq | fake quant | median step (ms) | vs off |", "|---|---|---|---|---|"]
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    return "\n".join([f"Machine: {machine}; {steps} timed steps per row after 1 warm-up.", "", *head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/qat_overhead.md"))
    args = parser.parse_args()
    table = run(args.steps)
    print(table)
    Path(args.out).write_text(f"Command: .venv/bin/python benchmarks/qat_overhead.py --steps {args.steps}\n\n"
                              + table + "\n")


if __name__ == "__main__":
    main()
