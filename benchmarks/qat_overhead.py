"""Learner step time with fake quantization on vs off, per scheme, measured in one run.

    .venv/bin/python benchmarks/qat_overhead.py [--steps 4] [--rounds 3] [--out benchmarks/results/qat_overhead.md]

Two models: the project's tiny Qwen3-MoE (checkpoints/tiny-qwen3-moe) and a wider random one
(hidden 2048, expert FFN 768, 2 layers, 16 experts top-4, head dim 128, 16 heads / 4 KV groups,
vocab 4096). One step = forward + backward + Adam step on the Megatron learner (TP1, fp32 master
weights); with fake quant on (ModelOpt quant modules on the one quantizer, qat/modules.py), each step
re-quantizes every targeted weight once (the optimizer changed it) and runs the forward on the low-bit values
(and W8A8's quantized activations). The "compile_quantizer" row runs that W4A16 refresh torch.compile'd
(learner.compile_quantizer; its one-off compile happens in the warm-up step, not timed).
Reported: median seconds per step and the ratio to quantization off, all in this one process. The off learner and
each scheme's take turns (``--rounds`` rounds of ``--steps`` steps each): a shared host whose speed drifts by more
than the overhead measured (seen here: the same step 1.0 s one hour, 2.5 s the next) slows both sides of a round
alike, so the ratio is taken per round and its median reported, with the rounds' range.
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


def learner_of(arch, scheme: str, compiled: bool = False):
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.qat.config import QuantConfig

    return Learner(arch, ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme=scheme),
                   compile_quantizer=compiled)


def time_steps(learner, arch, batch: int, seq: int, steps: int, gen: torch.Generator) -> list[float]:
    from megatron_qarl.learner.rank import Batch, token_mean_nll

    times = []
    for _ in range(steps):
        tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq - 1)
        t0 = time.perf_counter()
        learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.numel()))
        times.append(time.perf_counter() - t0)
    return times


def _pair(arch, off, scheme: str, compiled: bool, batch: int, seq: int, steps: int, rounds: int):
    """(median off step s, median scheme step s, median of the per-round ratios): the two learners take turns,
    ``steps`` steps each per round, after a warm-up step each, so a host that changes speed slows both alike."""
    fq = learner_of(arch, scheme, compiled)
    gen = torch.Generator().manual_seed(0)
    time_steps(fq, arch, batch, seq, 1, gen)  # warm-up (compile_quantizer compiles here)
    t_off, t_fq, ratios = [], [], []
    for _ in range(rounds):
        a = statistics.median(time_steps(off, arch, batch, seq, steps, gen))
        b = statistics.median(time_steps(fq, arch, batch, seq, steps, gen))
        t_off.append(a)
        t_fq.append(b)
        ratios.append(b / a)
    del fq
    return statistics.median(t_off), statistics.median(t_fq), statistics.median(ratios), ratios


def run(steps: int, rounds: int) -> str:
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel, run_ranks

    def body():
        init_parallel()
        tiny = Qwen3MoeArch.from_model_dir(REPO / "checkpoints/tiny-qwen3-moe")
        models = [("tiny (1.8M params, hidden 128)", tiny, 16, 64),
                  ("wide (hidden 2048, FFN 768, 16 experts, 2 layers)", wide_arch(), 2, 64)]
        rows = []
        for label, arch, batch, seq in models:
            off = learner_of(arch, "bf16")
            time_steps(off, arch, batch, seq, 1, torch.Generator().manual_seed(1))  # warm-up
            for scheme, compiled in SCHEMES[1:]:
                a, b, ratio, ratios = _pair(arch, off, scheme, compiled, batch, seq, steps, rounds)
                name = scheme + (" (compile_quantizer)" if compiled else "")
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if rounds > 1 else "-"
                rows.append(f"| {label} | {batch}x{seq} | {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {ratio:.2f}x | "
                            f"{spread} |")
            del off
        return rows

    rows = run_ranks(1, body)[0]
    head = ["| model | batch x seq | fake quant | off: median step (ms) | on: median step (ms) | vs off (median of "
            "rounds) | rounds' range |", "|---|---|---|---|---|---|---|"]
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    return "\n".join([f"Machine: {machine}; per scheme, {rounds} round(s) of {steps} timed steps of the off learner "
                      "then of the fake-quant one (after a warm-up step each); the ratio of their medians per "
                      "round, its median over rounds.", "", *head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per learner and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of off / on turns per scheme")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/qat_overhead.md"))
    args = parser.parse_args()
    table = run(args.steps, args.rounds)
    print(table)
    Path(args.out).write_text(f"Command: .venv/bin/python benchmarks/qat_overhead.py --steps {args.steps} --rounds "
                              f"{args.rounds}\n\n" + table + "\n")


if __name__ == "__main__":
    main()
