"""The FP8 KV cache (rollout.kv_cache_dtype, issue 54): the training-inference mismatch it adds and the alignment
removes, by response position, and the embedded engine's decode speed and KV bytes per token, bf16 vs FP8.

    .venv/bin/python benchmarks/kv_cache.py [--out benchmarks/results/kv_cache.md] [--rows 8] [--new 512]

The project's tiny Qwen3-MoE with its context raised to 1024 positions (a copy whose config.json says
max_position_embeddings 1024, same weights: rotary embeddings extend to any length; the model was trained on
short sequences, so its long continuations are noise, which is all the measurement needs), W4A16 as the main job
(the export the servers load; the learner's aligned fake-quant weights are the same codes), ``--rows`` prompts of 8
random tokens, ``--new`` new tokens each at temperature 1 with EOS ignored. The sampler is the embedded engine's
model and sampling (serve/model.py, serve/sampling.py: what a server answers, in one process); the learner is the
Megatron learner (TP 1, float32 master weights, aligned), scoring the sampled sequences in one forward. Per token:
|logp_learner - logp_sampler|, its mean per bucket of response positions, for

    (a) bf16 KV          the servers' cache in their compute dtype (rollout.kv_cache_dtype auto)
    (b) FP8 KV unaware   the servers' cache in FP8, the learner's attention on its own keys and values
    (c) FP8 KV aligned   the same servers, the learner's keys and values rounded as the cache (qat/kv_cache.py)

for e4m3 and e5m2, with the servers in bfloat16 (the main job's servers: the rest of their arithmetic differs from
the float32 learner's too) and in float32 (that difference gone: what is left is the KV cache's part). Decode: the
engine model's forward alone at batch ``--rows`` over ``--new`` steps after an 8-token prefill (the context growing
to 520 tokens), tokens/s = rows x steps / seconds, the best of ``--repeats`` interleaved runs, bf16 servers; the KV
bytes per token are the engine's cache's (serve/model.py ``cache_bytes_per_token``) and Qwen3-30B-A3B's at one GPU
(plan/memory.py ``kv_bytes_per_token``).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "checkpoints" / "tiny-qwen3-moe"
BUCKETS = ((0, 64), (64, 128), (128, 256), (256, 512))
FORMATS = ("fp8_e4m3", "fp8_e5m2")


def long_context_copy(out: Path, positions: int = 1024) -> str:
    """The tiny checkpoint with config.json's max_position_embeddings raised (the weights linked, not copied)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in MODEL.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((MODEL / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def sample_rollouts(model_dir: str, dtype: torch.dtype, kv: str, rows: int, new: int,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [rows, 8 + new], the sampler's log-probs of the new tokens [rows, new]): the engine's prefill of 8
    random prompt tokens, then ``new`` batched decode steps, each row sampled from its own seeded generator as a
    server samples a request."""
    from megatron_qarl.serve.model import Qwen3MoeEngineModel
    from megatron_qarl.serve.request import SamplingParams
    from megatron_qarl.serve.sampling import sample

    model = Qwen3MoeEngineModel.from_model_dir(model_dir, dtype, rows, 8 + new, kv_cache_dtype=kv)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_new_tokens=new)
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(rows)]
    tokens = torch.randint(3, 32, (rows, 8 + new), generator=torch.Generator().manual_seed(seed))
    logp = torch.zeros(rows, new)
    slots = torch.arange(rows)
    logits = model.forward(tokens[:, :8], slots, torch.arange(8)[None].expand(rows, 8))
    for t in range(new):
        for r in range(rows):
            tok, lp = sample(logits[r], params, gens[r], False)
            tokens[r, 8 + t], logp[r, t] = tok, lp
        if t + 1 < new:
            logits = model.forward(tokens[:, 8 + t : 9 + t], slots, torch.full((rows, 1), 8 + t))
    return tokens, logp


def _learner_logprobs(model_dir: str, kv: str | None, act: torch.dtype, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.kv_cache import KVCacheSpec

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=1, ep=1, seed=7)
    spec = KVCacheSpec.build(kv, act, arch.num_hidden_layers) if kv else None
    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-5), quant=QuantConfig(scheme="w4a16"),
                      kv_cache=spec)
    learner.load_hf(model_dir)
    with torch.no_grad():
        return learner.forward_logprobs(tokens)


def learner_logprobs(model_dir: str, kv: str | None, act: torch.dtype, tokens: torch.Tensor) -> torch.Tensor:
    """The aligned learner's log-probs of the new tokens [rows, new]: its attention on the FP8 cache's keys and values
    (``kv``) or on its own (None)."""
    from megatron_qarl.moe.parallelize import run_ranks

    return run_ranks(1, _learner_logprobs, model_dir, kv, act, tokens)[0][:, 7:]


def buckets(d: torch.Tensor) -> list[float]:
    """Mean |d| [rows, new] over each bucket of response positions."""
    return [float(d[:, a:b].abs().mean()) for a, b in BUCKETS if a < d.shape[1]]


def measure(model_dir: str, served: str, rows: int, new: int, repeats: int) -> dict:
    """Every arm's per-bucket mismatch, both server dtypes; decode tokens/s and KV bytes per token."""
    out: dict = {"mismatch": {}, "decode": {}}
    for act in (torch.bfloat16, torch.float32):
        name = str(act).removeprefix("torch.")
        tokens, logp = sample_rollouts(served, act, "auto", rows, new)
        out["mismatch"][(name, "a", "auto")] = buckets(learner_logprobs(model_dir, None, act, tokens) - logp)
        for kv in FORMATS:
            tokens, logp = sample_rollouts(served, act, kv, rows, new)
            out["mismatch"][(name, "b", kv)] = buckets(learner_logprobs(model_dir, None, act, tokens) - logp)
            out["mismatch"][(name, "c", kv)] = buckets(learner_logprobs(model_dir, kv, act, tokens) - logp)
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.plan.memory import kv_bytes_per_token
    from megatron_qarl.serve.model import Qwen3MoeEngineModel, cache_bytes_per_token

    big = Qwen3MoeArch.from_model_dir(REPO / "configs" / "models" / "qwen3-30b-a3b")
    speeds: dict[str, list[float]] = {kv: [] for kv in ("auto", *FORMATS)}
    for _ in range(repeats):  # interleaved: a load change on the shared machine hits every cache alike
        for kv in speeds:
            speeds[kv].append(decode_tokens_per_s(served, kv, rows, new))
    for kv in speeds:
        m = Qwen3MoeEngineModel.from_model_dir(served, torch.bfloat16, 1, 8, kv_cache_dtype=kv)
        out["decode"][kv] = {"tokens_per_s": max(speeds[kv]), "bytes_per_token": cache_bytes_per_token(m),
                             "qwen3_30b_bytes_per_token": kv_bytes_per_token(big, 1, 2 if kv == "auto" else 1)}
    return out


def decode_tokens_per_s(served: str, kv: str, rows: int, new: int) -> float:
    """The engine model's decode alone (no sampling): ``rows`` sequences from an 8-token prefill through ``new``
    steps, bf16; tokens/s = rows x new / seconds."""
    from megatron_qarl.serve.model import Qwen3MoeEngineModel

    model = Qwen3MoeEngineModel.from_model_dir(served, torch.bfloat16, rows, 8 + new, kv_cache_dtype=kv)
    tokens, slots = torch.randint(3, 32, (rows, 8), generator=torch.Generator().manual_seed(1)), torch.arange(rows)
    model.forward(tokens, slots, torch.arange(8)[None].expand(rows, 8))
    start = time.perf_counter()
    for t in range(8, 8 + new):
        model.forward(tokens[:, :1], slots, torch.full((rows, 1), t))
    return rows * new / (time.perf_counter() - start)


def render(res: dict, rows: int, new: int) -> str:
    heads = [f"{a}-{b}" for a, b in BUCKETS if a < new]
    lines = ["# FP8 KV cache: mismatch by response position, decode speed (benchmarks/kv_cache.py)\n",
             f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
             f"threads; tiny Qwen3-MoE (context 1024), W4A16, {rows} rows x {new} new tokens at temperature 1, "
             "float32 aligned learner (TP 1).\n",
             "Mean per-token |logp_learner - logp_sampler| by response position:\n",
             f"| servers | arm | KV cache | {' | '.join(heads)} | all |", "|---|---|---|" + "---|" * (len(heads) + 1)]
    names = {"a": "(a) bf16 KV", "b": "(b) FP8 KV, learner unaware", "c": "(c) FP8 KV, learner aligned"}
    for (act, arm, kv), vals in res["mismatch"].items():
        overall = sum(v * (min(b, new) - a) for v, (a, b) in zip(vals, BUCKETS, strict=False)) / new
        lines.append(f"| {act} | {names[arm]} | {kv} | {' | '.join(f'{v:.2e}' for v in vals)} | {overall:.2e} |")
    lines += ["", f"Embedded engine decode, bf16 servers, batch {rows}, context 8 -> {8 + new}:\n",
              "| KV cache | decode tokens/s | vs bf16 KV | KV bytes / token (tiny) | KV bytes / token "
              "(Qwen3-30B-A3B, 1 GPU) |",
              "|---|---|---|---|---|"]
    base = res["decode"]["auto"]["tokens_per_s"]
    for kv, d in res["decode"].items():
        lines.append(f"| {'bf16 (auto)' if kv == 'auto' else kv} | {d['tokens_per_s']:.0f} | "
                     f"{d['tokens_per_s'] / base:.2f} | {d['bytes_per_token']} | {d['qwen3_30b_bytes_per_token']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from megatron_qarl.qat.config import QuantConfig
    from megatron_qarl.qat.export import quantize_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="kv_cache_bench_"))
    try:
        model_dir = long_context_copy(tmp / "model")
        served = tmp / "w4a16"
        q = QuantConfig(scheme="w4a16")
        quantize_checkpoint(model_dir, q.scheme, served, group_size=q.group_size, symmetric=q.symmetric)
        text = render(measure(model_dir, str(served), args.rows, args.new, args.repeats), args.rows, args.new)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
