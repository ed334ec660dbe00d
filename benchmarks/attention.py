"""The local spec's core attention on CPU, torch's fused SDPA against Megatron's unfused DotProductAttention (issue 55):
aten ops, host reads, peak memory and time of a forward + backward, measured in one run.

    .venv/bin/python benchmarks/attention.py [--seqs 1024 4096] [--repeats 3]
        [--out benchmarks/results/attention_cpu.md]
    .venv/bin/python benchmarks/attention.py --learner [--repeats 5]        (the main job's learner step, below)

The model: one Megatron layer (``moe.model.build_model``, the local spec) of what one TP4 rank of Qwen3-30B-A3B holds
in its attention (8 query heads, 1 KV group of 128, hidden 2048), 8 experts top-2 of FFN 768 and a 1024-token
vocabulary (the experts and vocabulary cut so that the attention's share is visible), bf16, one sequence of s tokens.
A forward + backward: logits -> float logsumexp mean -> backward. Per attention and s:
  - aten ops and host reads (``_local_scalar_dense``, ``item``, ``is_nonzero``, ``nonzero``) seen by a
    TorchDispatchMode;
  - the peak live bytes of every tensor an aten op returned (``plan.tracker.AllocationTracker``: a storage counts
    while a tensor holds it; the parameters and the inputs, made before, are not counted), beside one layer's s x s
    scores in fp32, a * s^2 * 4 B;
  - wall seconds, the median of ``--repeats`` runs, the two attentions alternating (the counting runs are apart).

``--learner``: configs/cpu_default.yaml's learner step (the tiny model, W4A16 fake quant, float32, one rank) on a
batch shaped like its steps, 128 rows right-padded to 62 tokens, each row 32-62 long with its loss from token 13 on
(the runs' padded fraction, ``length/padded_frac``, was 24%): the aligned log-prob forward and a train step with the
unfused attention, sdpa on the padded rows, and sdpa packed (learner/packing.py), alternating, the median of
``--repeats`` after a warm-up round.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[1]
SYNCS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default", "aten.nonzero.default"}
ATTENTIONS = ("unfused", "sdpa")


class Counted(TorchDispatchMode):
    """aten ops, host reads and (with a tracker) the live bytes of what the ops return."""

    def __init__(self, tracker=None):
        super().__init__()
        self.ops, self.syncs, self.tracker = 0, 0, tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += str(func) in SYNCS
        out = func(*args, **(kwargs or {}))
        if self.tracker is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.tracker.add(t)
        return out


def layer_arch(seq: int):
    from megatron_qarl.moe.model import Qwen3MoeArch

    base = Qwen3MoeArch.from_model_dir(REPO / "configs" / "models" / "qwen3-30b-a3b")
    return dataclasses.replace(base, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=1,
                               num_experts=8, num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=seq)


def _model(attention: str, seq: int):
    """The one-layer model (module docstring) with ``attention`` and its forward + backward of ``seq`` tokens."""
    from megatron_qarl.moe.model import attention_mask, build_model

    arch = layer_arch(seq)
    torch.manual_seed(0)
    model = build_model(arch, dtype=torch.bfloat16, attention=attention)
    tokens = torch.randint(0, arch.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    positions, mask = torch.arange(seq)[None], attention_mask(attention, seq)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        model(tokens, positions, mask).float().logsumexp(-1).mean().backward()

    return fwd_bwd, arch.num_attention_heads * seq**2 * 4


def run(seq: int, repeats: int) -> dict:
    """Both attentions at ``seq``: each counted once after a warm-up, then timed alternately ``repeats`` times."""
    from megatron_qarl.plan.tracker import AllocationTracker

    fns, out = {}, {}
    for attention in ATTENTIONS:
        fns[attention], scores = _model(attention, seq)
        fns[attention]()  # warm-up
        tracker = AllocationTracker()
        with Counted(tracker) as counted:
            fns[attention]()
        out[attention] = {"ops": counted.ops, "syncs": counted.syncs, "peak": tracker.peak, "scores": scores,
                          "times": []}
    for _ in range(repeats):
        for attention in ATTENTIONS:
            t0 = time.perf_counter()
            fns[attention]()
            out[attention]["times"].append(time.perf_counter() - t0)
    for r in out.values():
        r["seconds"] = statistics.median(r.pop("times"))
    return out


def render(rows: dict, seqs: list[int], repeats: int) -> str:
    out = [f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch "
           f"{torch.__version__}; one layer (8 / 1 heads of 128, hidden 2048, 8 experts), bf16, one sequence; "
           f"forward + backward, median of {repeats}.", "",
           "| s | attention | aten ops | host reads | peak MiB | one layer's fp32 scores MiB | seconds | "
           "sdpa / unfused: ops, peak, time |", "|---|---|---|---|---|---|---|---|"]
    for seq in seqs:
        u = rows[("unfused", seq)]
        for att in ATTENTIONS:
            r = rows[(att, seq)]
            ratio = (f"{r['ops'] / u['ops']:.2f}, {r['peak'] / u['peak']:.3f}, {r['seconds'] / u['seconds']:.2f}"
                     if att == "sdpa" else "-")
            out.append(f"| {seq} | {att} | {r['ops']} | {r['syncs']} | {r['peak'] / 2**20:.0f} | "
                       f"{r['scores'] / 2**20:.0f} | {r['seconds']:.3f} | {ratio} |")
    return "\n".join(out) + "\n"


def learner_step(repeats: int) -> str:
    """``--learner`` (module docstring): a markdown table of the three learners' seconds."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.packing import loss_lengths
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.qat.config import QuantConfig

    tiny = REPO / "checkpoints" / "tiny-qwen3-moe"
    g = torch.Generator().manual_seed(0)
    rows, seq = 128, 62
    lengths = torch.randint(32, seq + 1, (rows,), generator=g).tolist()
    tokens = torch.randint(4, 30, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq - 1)
    for i, n in enumerate(lengths):
        mask[i, 13: n - 1] = 1
    batch, needed = Batch(tokens, mask), loss_lengths(mask)
    learners = {}
    for name, attention, packs in (("unfused", "unfused", False), ("sdpa, padded", "sdpa", False),
                                   ("sdpa, packed", "sdpa", True)):
        torch.manual_seed(0)
        learner = Learner(Qwen3MoeArch.from_model_dir(tiny), ParallelConfig(), OptimConfig(lr=1e-5),
                          quant=QuantConfig(scheme="w4a16"), attention=attention)
        learner.load_hf(str(tiny))
        learner.packs = packs
        learners[name] = learner
    times = {name: ([], []) for name in learners}
    for round_ in range(repeats + 1):
        for name, learner in learners.items():
            t0 = time.perf_counter()
            learner.forward_logprobs(tokens, lengths=needed)
            t1 = time.perf_counter()
            learner.train_step(batch, lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.sum()))
            if round_:  # the first round warms up
                times[name][0].append(t1 - t0)
                times[name][1].append(time.perf_counter() - t1)
    padded = 1 - sum(lengths) / (rows * seq)
    out = [f"cpu_default's learner step: 128 rows padded to 62 tokens ({100 * padded:.0f}% padding), tiny model, "
           f"W4A16, float32; median of {repeats}, alternating.", "",
           "| learner | log-prob forward s | train step s | vs unfused |", "|---|---|---|---|"]
    base = sum(statistics.median(t) for t in times["unfused"])
    for name, (fwd, step) in times.items():
        f, st = statistics.median(fwd), statistics.median(step)
        out.append(f"| {name} | {f:.3f} | {st:.3f} | {(f + st) / base:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--learner", action="store_true", help="the main job's learner step instead (docstring)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from megatron_qarl.moe.parallelize import init_parallel, single_rank_env

    single_rank_env()
    init_parallel()
    if args.learner:
        text = learner_step(args.repeats)
    else:
        rows = {(att, seq): r for seq in args.seqs for att, r in run(seq, args.repeats).items()}
        text = render(rows, args.seqs, args.repeats)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
