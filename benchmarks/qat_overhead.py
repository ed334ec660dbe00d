"""Learner step time with fake quantization on vs off, per scheme and expert implementation, measured in one run.

    .venv/bin/python benchmarks/qat_overhead.py [--steps 4] [--rounds 3] [--experts sequential grouped]
        [--models tiny wide wide64] [--out benchmarks/results/qat_overhead.md]

Three models: the project's tiny Qwen3-MoE (checkpoints/tiny-qwen3-moe), a wider random one
(hidden 2048, expert FFN 768, 2 layers, 16 experts top-4, head dim 128, 16 heads / 4 KV groups,
vocab 4096), and a 64-expert one (hidden 1024, expert FFN 384, 2 layers, 64 experts top-8, 8 heads / 2 KV groups),
each with the local spec's experts as Megatron's SequentialMLP and as grouped GEMMs (model.experts, moe/grouped.py);
the "grouped vs sequential" column is the off learners' step times in the same rounds.
One step = forward + backward + Adam step on the Megatron learner (TP1, fp32 master
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


def wide_arch(experts: int = 16):
    """The wide model (16 experts), or its 64-expert variant at half the width (its fp32 weights, gradients and Adam
    moments, two learners at a time, fit a 24 GiB machine)."""
    from megatron_qarl.moe.model import Qwen3MoeArch

    wide = experts <= 16
    return Qwen3MoeArch(vocab_size=4096, hidden_size=2048 if wide else 1024, num_hidden_layers=2,
                        num_attention_heads=16 if wide else 8, num_key_value_heads=4 if wide else 2, head_dim=128,
                        num_experts=experts, num_experts_per_tok=4 if wide else 8,
                        moe_intermediate_size=768 if wide else 384, intermediate_size=6144, rms_norm_eps=1e-6,
                        rope_theta=1e6, max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False,
                        attention_bias=False)


def learner_of(arch, scheme: str, compiled: bool = False, experts: str = "grouped"):
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.qat.config import QuantConfig

    return Learner(arch, ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme=scheme),
                   compile_quantizer=compiled, experts=experts)


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


def _pair(arch, off, scheme: str, compiled: bool, batch: int, seq: int, steps: int, rounds: int,
          experts: str = "grouped"):
    """(median off step s, median scheme step s, median of the per-round ratios): the two learners take turns,
    ``steps`` steps each per round, after a warm-up step each, so a host that changes speed slows both alike."""
    fq = learner_of(arch, scheme, compiled, experts)
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


MODELS = ("tiny", "wide", "wide64")


def _models(names: tuple[str, ...]) -> list:
    from megatron_qarl.moe.model import Qwen3MoeArch

    tiny = Qwen3MoeArch.from_model_dir(REPO / "checkpoints/tiny-qwen3-moe")
    chosen = {"tiny": ("tiny (1.8M params, hidden 128, 8 experts)", tiny, 16, 64),
              "wide": ("wide (hidden 2048, FFN 768, 16 experts, 2 layers)", wide_arch(16), 2, 64),
              "wide64": ("wide64 (hidden 1024, FFN 384, 64 experts top-8, 2 layers)", wide_arch(64), 2, 64)}
    return [chosen[m] for m in names]


def _in_process(fn, *args, timeout: float = 3600.0) -> list:
    """``fn(*args)`` in a fresh one-rank process (spawned; ``fn`` a module-level function): a learner's memory is
    not all returned to the host when it is dropped (Megatron's and ModelOpt's global state keep references), and at
    the wide model's size (~3 GiB of fp32 weights, gradients and Adam moments each) the learners of one model's every
    scheme and both expert implementations do not fit a 24 GiB machine in one process. Bounded by ``timeout``."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_one_rank, fn, *args).result(timeout=timeout)


def _one_rank(fn, *args):
    from megatron_qarl.moe.parallelize import init_parallel, run_ranks

    def body():
        init_parallel()
        return fn(*args)

    return run_ranks(1, body)[0]


def _versus(m: str, experts: tuple[str, ...], steps: int, rounds: int) -> list[str]:
    """The two expert implementations' off learners, taking turns."""
    (label, arch, batch, seq), = _models((m,))
    first, second = (learner_of(arch, "bf16", experts=impl) for impl in experts)
    for off in (first, second):
        time_steps(off, arch, batch, seq, 1, torch.Generator().manual_seed(1))  # warm-up
    a, b, ratio, ratios = _turns(arch, first, second, batch, seq, steps, rounds)
    return [_row(label, batch, seq, f"off: {experts[1]} vs {experts[0]}", a, b, ratio, ratios)]


def _scheme(m: str, impl: str, scheme: str, compiled: bool, steps: int, rounds: int) -> list[str]:
    """One scheme's learner against the off one, both with ``impl``'s experts."""
    (label, arch, batch, seq), = _models((m,))
    off = learner_of(arch, "bf16", experts=impl)
    time_steps(off, arch, batch, seq, 1, torch.Generator().manual_seed(1))  # warm-up
    a, b, ratio, ratios = _pair(arch, off, scheme, compiled, batch, seq, steps, rounds, impl)
    name = scheme + (" (compile_quantizer)" if compiled else "")
    return [_row(label, batch, seq, f"{impl}: {name}", a, b, ratio, ratios)]


def run(steps: int, rounds: int, experts: tuple[str, ...] = ("sequential", "grouped"),
        models: tuple[str, ...] = MODELS) -> str:
    rows = []
    for m in models:
        if len(experts) == 2:
            rows += _in_process(_versus, m, experts, steps, rounds)
        for impl in experts:
            for scheme, compiled in SCHEMES[1:]:
                rows += _in_process(_scheme, m, impl, scheme, compiled, steps, rounds)
    head = ["| model | batch x seq | experts: fake quant | off: median step (ms) | on: median step (ms) | vs off "
            "(median of rounds) | rounds' range |", "|---|---|---|---|---|---|---|"]
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    return "\n".join([f"Machine: {machine}; per scheme, {rounds} round(s) of {steps} timed steps of the off learner "
                      "then of the fake-quant one (after a warm-up step each; each pair in a process of its own); "
                      "the ratio of their medians per round, its median over rounds. The \"off\" rows set the two "
                      "expert implementations' off learners against each other the same way (the second column is "
                      "the first implementation's).",
                      "", *head, *rows])


def _turns(arch, first, second, batch: int, seq: int, steps: int, rounds: int):
    """``_pair`` for two learners already built."""
    gen = torch.Generator().manual_seed(0)
    t_a, t_b, ratios = [], [], []
    for _ in range(rounds):
        a = statistics.median(time_steps(first, arch, batch, seq, steps, gen))
        b = statistics.median(time_steps(second, arch, batch, seq, steps, gen))
        t_a.append(a)
        t_b.append(b)
        ratios.append(b / a)
    return statistics.median(t_a), statistics.median(t_b), statistics.median(ratios), ratios


def _row(label: str, batch: int, seq: int, name: str, a: float, b: float, ratio: float, ratios: list) -> str:
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 else "-"
    return f"| {label} | {batch}x{seq} | {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {ratio:.2f}x | {spread} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per learner and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of off / on turns per scheme")
    parser.add_argument("--experts", nargs="+", choices=("sequential", "grouped"), default=["sequential", "grouped"],
                        help="the expert implementations (model.experts) measured")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/qat_overhead.md"))
    args = parser.parse_args()
    table = run(args.steps, args.rounds, tuple(args.experts), tuple(args.models))
    print(table)
    Path(args.out).write_text(f"Command: .venv/bin/python benchmarks/qat_overhead.py --steps {args.steps} --rounds "
                              f"{args.rounds} --experts {' '.join(args.experts)} --models {' '.join(args.models)}"
                              "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
