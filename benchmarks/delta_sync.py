"""Delta vs full weight sync, W4A16: wire bytes and seconds per sync after real optimizer steps, and the
server checksums of the two after every step.

Per model and learning rate, in a fresh process: one learner rank (Megatron, gloo, aligned W4A16 fake quant,
Adam at ``lr``, fp32 master weights) and two `qarl serve --dtype bfloat16` processes started from the same
W4A16 checkpoint. Every step is one Adam step on the token NLL of random sequences (a fresh batch each step),
then the learner's payload is produced once (the W4A16 quantization of every expert; timed as "payload s"),
then a full sync goes to one server and a delta sync (``DistributedBroadcaster(delta=True)``) to the other,
both in bf16 with the default 512 MiB buckets. Step 0 is the initial sync (full on both). After each step
the two servers' /weights_checker checksums (SGLang's definition, sync/checksum.py) must be equal: the
delta-synced server is bit-identical to the fully synced one (the benchmark stops otherwise).

Reported per (model, lr): bytes on the wire per sync (a delta counts its index tensors), delta / full,
seconds per sync (the whole cycle: pause, flush, session, buckets, server apply + repack, continue; for a
delta also the diff on the learner and the checksum check, whose seconds are given apart), and what each
fixed granularity would have sent for the same changes (sync/delta.py's formula wire(b) = |C_b| (b s + s_idx)):
one element (an int32 word of 8 int4 codes, a scale, a bf16 weight), a W4A16 group (16 words of
weight_packed; a scale is one element per group), a row, the whole tensor, and the per-tensor choice the
encoder makes -- split between the low-bit tensors (weight_packed / weight_scale / weight_shape) and the
high-precision ones (attention, router, norms, embeddings, lm_head).

Models: the project's tiny checkpoint (fp32) and the Qwen3-30B-A3B-shaped slice of benchmarks/sync.py
(hidden 2048, 32/4 heads x 128, 32 experts x FFN 768, top-8, 2 layers, vocab 4096, random bf16 weights).

    .venv/bin/python benchmarks/delta_sync.py [--steps 20] [--lrs 1e-5,1e-6] [--models tiny,slice]

Writes benchmarks/results/delta_sync.md and delta_sync.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from megatron_qarl.qat.export import quantize_checkpoint

OUT = Path(__file__).resolve().parent / "results" / "delta_sync"
BATCH = {"tiny": (16, 64), "slice": (2, 64)}  # sequences x tokens per optimizer step
LOW_BIT = ("weight_packed", "weight_scale", "weight_shape")
POLICIES = ("element", "group", "row", "tensor", "auto")


def granularity_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, dict[str, int]]:
    """{"low_bit" | "high_precision": {policy: wire bytes, "full": bytes}} for the change old -> new."""
    from megatron_qarl.sync import delta

    out = {kind: dict.fromkeys((*POLICIES, "full"), 0) for kind in ("low_bit", "high_precision")}
    for name, t in new.items():
        elements = delta.changed_elements(old[name], t)
        block, costs = delta.choose_block(elements, t.shape, t.element_size())
        group = 16 if name.endswith("weight_packed") and t.shape[-1] % 16 == 0 else 1
        counts = delta.changed_blocks(elements, {1, group, t.shape[-1], t.numel()})
        row = out["low_bit" if name.endswith(LOW_BIT) else "high_precision"]
        for policy, b in (("element", 1), ("group", group), ("row", t.shape[-1]), ("tensor", t.numel())):
            row[policy] += delta.wire_bytes(counts[b], b, t.numel(), t.element_size())
        row["auto"] += costs[block] if block else 0
        row["full"] += t.numel() * t.element_size()
    return out


def held_checksum(url: str) -> str:
    r = httpx.post(url + "/weights_checker", json={"action": "checksum"}, timeout=300)
    r.raise_for_status()
    return r.json()["per_engine_checksum"]


def measure(model_dir: str, lr: float, full_url: str, delta_url: str, steps: int, batch: tuple[int, int],
            threads: int) -> dict:
    """One learner rank, ``steps`` Adam steps, a full and a delta sync after each (see the module docstring)."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.sync.broadcaster import DistributedBroadcaster, Engine
    from megatron_qarl.sync.payload import iter_sync_tensors

    torch.set_num_threads(threads)
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(seed=0)
    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=lr), quant=QuantConfig(scheme="w4a16"), aligned=True)
    learner.load_hf(model_dir)
    full = DistributedBroadcaster([Engine(full_url)], dtype=torch.bfloat16, group_name="full")
    part = DistributedBroadcaster([Engine(delta_url)], dtype=torch.bfloat16, group_name="delta", delta=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for step in range(steps + 1):
        row: dict = {"step": step}
        if step:
            tokens = torch.randint(4, arch.vocab_size, batch, generator=gen)
            mask = torch.ones(batch[0], batch[1] - 1)
            n_tokens = int(mask.sum())
            t0 = time.perf_counter()
            metrics = learner.train_step(Batch(tokens, mask), lambda lp, b, n=n_tokens: token_mean_nll(lp, b, n))
            row.update(step_s=time.perf_counter() - t0, loss=metrics["loss"])
        t0 = time.perf_counter()
        for _ in iter_sync_tensors(learner, torch.bfloat16):  # quantize once, outside both syncs' timing
            pass
        row["payload_s"] = time.perf_counter() - t0
        before = {n: t.clone() for n, t in part.baseline.tensors.items()} if part.baseline else None
        r_full, r_delta = full.sync(learner), part.sync(learner)
        equal = held_checksum(full_url) == held_checksum(delta_url)
        row.update(full_bytes=r_full.bytes, full_s=r_full.seconds, delta_bytes=r_delta.bytes, delta_s=r_delta.seconds,
                   check_s=r_delta.check_s, mode=r_delta.mode, reason=r_delta.full_reason,
                   blocks={str(b): n for b, n in sorted(r_delta.blocks.items())}, checksums_equal=equal)
        if before is not None:
            row["granularity"] = granularity_bytes(before, part.baseline.tensors)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "granularity"}), flush=True)
        if not equal:
            raise AssertionError(f"step {step}: the delta-synced server's checksum differs from the full sync's")
    full.close()
    part.close()
    return {"rows": rows}


def _in_fresh_process(*args) -> dict:
    """measure() as one gloo rank in this (fresh, spawned) process: each run's learner memory is returned."""
    from megatron_qarl.moe.parallelize import run_ranks

    return run_ranks(1, measure, *args)[0]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sync import TINY, start_server, write_slice

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lrs", default="1e-5,1e-6")
    ap.add_argument("--models", default="tiny,slice")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner and of each server")
    args = ap.parse_args()
    start = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            base = TINY if model == "tiny" else write_slice(Path(tmp) / "slice")
            served = quantize_checkpoint(base, "w4a16", Path(tmp) / f"{model}-w4a16")
            for lr in (float(x) for x in args.lrs.split(",")):
                servers = [start_server(Path(served), args.threads, Path(tmp) / f"server{i}.log") for i in range(2)]
                try:
                    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                        out = pool.submit(_in_fresh_process, str(base), lr, servers[0].url, servers[1].url,
                                          args.steps, BATCH[model], args.threads).result()
                finally:
                    for s in servers:
                        s.stop()
                runs.append({"model": model, "lr": lr, **out})
    seconds = time.perf_counter() - start
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(runs, indent=1))
    text = render(runs, args, seconds)
    OUT.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {OUT}.md and .json")


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def render(runs: list[dict], args, seconds: float) -> str:
    med = statistics.median
    cmd = " ".join(["benchmarks/delta_sync.py", *sys.argv[1:]])
    lines = [
        "# Delta vs full weight sync, W4A16 (benchmarks/delta_sync.py)", "",
        f"Command: `.venv/bin/python {cmd}` ({seconds / 60:.0f} min). Per model and lr: one learner rank (aligned "
        f"W4A16, Adam, fp32 master weights), {args.steps} optimizer steps on the token NLL of random sequences, "
        "after each a full sync to one `qarl serve --dtype bfloat16` and a delta sync to another (bf16, 512 MiB "
        f"buckets, {args.threads} torch thread(s) each, gloo on loopback). Step 0 is the initial sync (full on "
        "both). Medians over steps 1..N; 'step 1' and 'max' apart. 'delta s / full s': the median of the "
        "per-step ratios (the two syncs of a step run back to back, under the same load).", "",
        "## Bytes and seconds per sync", "",
        "| model | lr | full MB | delta MB (median) | delta / full: median | step 1 | max | full s | delta s | "
        "of which check s | delta s / full s | payload s | checksums equal | delta syncs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        rows = run["rows"][1:]
        ratio = [r["delta_bytes"] / r["full_bytes"] for r in rows]
        equal = sum(r["checksums_equal"] for r in run["rows"])
        deltas = sum(r["mode"] == "delta" for r in rows)
        lines.append(
            f"| {run['model']} | {run['lr']:g} | {rows[0]['full_bytes'] / 1e6:.2f} | "
            f"{med(r['delta_bytes'] for r in rows) / 1e6:.2f} | {_pct(med(ratio))} | {_pct(ratio[0])} | "
            f"{_pct(max(ratio))} | {med(r['full_s'] for r in rows):.2f} | {med(r['delta_s'] for r in rows):.2f} | "
            f"{med(r['check_s'] for r in rows):.2f} | {med(r['delta_s'] / r['full_s'] for r in rows):.2f} | "
            f"{med(r['payload_s'] for r in rows):.2f} | "
            f"{equal}/{len(run['rows'])} | {deltas}/{len(rows)} |")
    lines += ["", "## Which granularity: wire bytes as % of the full sync, median over steps", "",
              "Each column sends the same changes at one fixed block size (index bytes included); 'auto' is the "
              "encoder's per-tensor choice, which the delta syncs above used.", "",
              "| model | lr | tensors | " + " | ".join(POLICIES) + " |", "|---|---|---|" + "---|" * len(POLICIES)]
    for run in runs:
        rows = [r for r in run["rows"] if "granularity" in r]
        for kind in ("low_bit", "high_precision", "all"):
            def share(r, p, kind=kind):
                g = r["granularity"]
                kinds = ("low_bit", "high_precision") if kind == "all" else (kind,)
                return sum(g[k][p] for k in kinds) / sum(g[k]["full"] for k in ("low_bit", "high_precision"))
            lines.append(f"| {run['model']} | {run['lr']:g} | {kind.replace('_', '-')} | "
                         + " | ".join(_pct(med(share(r, p) for r in rows)) for p in POLICIES) + " |")
    lines += ["", "## Delta / full per step", ""]
    for run in runs:
        ratio = " ".join(f"{100 * r['delta_bytes'] / r['full_bytes']:.1f}" for r in run["rows"][1:])
        lines.append(f"- {run['model']}, lr {run['lr']:g} (%): {ratio}")
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
