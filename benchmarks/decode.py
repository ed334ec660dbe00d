"""Decode throughput of the embedded rollout engine per weight format, against transformers' generate.

Model: a Qwen3-30B-A3B-shaped slice with random weights made on the fly: hidden 2048, 32 query heads / 4 KV
heads of dim 128, 128 experts with FFN 768, top-8, 2 layers, vocab 4096 (kept small on purpose so that
lm_head, which stays BF16 in every scheme, does not dominate the bytes of a 2-layer slice).
Per scheme, the bytes of weights read per decoded token at batch 1 (attention + router + the top-8
experts + lm_head + one embedding row + norms + the KV cache at the mean context) give the speedup over
BF16 that memory bandwidth allows; we report the achieved speedup and the achieved GB/s against a
bandwidth measured here (a 1 GiB read with the same thread count). Decode time excludes the prefill:
the clock starts when every sequence has its first token.

    .venv/bin/python benchmarks/decode.py [--steps 16] [--threads 2]

Prints a markdown table and writes it to benchmarks/results/decode.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import threading
import time
from pathlib import Path

import torch

from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import export_state_dict
from megatron_qarl.rollout.engine import Engine, EngineConfig, SamplingParams
from megatron_qarl.rollout.model import Qwen3MoeEngineModel

CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 2048, "num_hidden_layers": 2,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144, "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "max_position_embeddings": 256, "norm_topk_prob": True,
    "tie_word_embeddings": False, "attention_bias": False,
}
BATCHES = (1, 4, 16)
PROMPT_LEN = 16
OUT = Path(__file__).resolve().parent / "results" / "decode.md"


def random_state_dict(arch: Qwen3MoeArch, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named bf16 weights, N(0, 0.02) (norms 1): the values do not matter for throughput."""
    g = torch.Generator().manual_seed(seed)
    h, d, i = arch.hidden_size, arch.head_dim, arch.moe_intermediate_size

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(arch.vocab_size, h), "lm_head.weight": w(arch.vocab_size, h),
          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for li in range(arch.num_hidden_layers):
        p = f"model.layers.{li}"
        sd |= {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               f"{p}.self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
               f"{p}.self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
               f"{p}.self_attn.q_proj.weight": w(arch.num_attention_heads * d, h),
               f"{p}.self_attn.k_proj.weight": w(arch.num_key_value_heads * d, h),
               f"{p}.self_attn.v_proj.weight": w(arch.num_key_value_heads * d, h),
               f"{p}.self_attn.o_proj.weight": w(h, arch.num_attention_heads * d),
               f"{p}.mlp.gate.weight": w(arch.num_experts, h)}
        for e in range(arch.num_experts):
            q = f"{p}.mlp.experts.{e}"
            sd |= {f"{q}.gate_proj.weight": w(i, h), f"{q}.up_proj.weight": w(i, h), f"{q}.down_proj.weight": w(h, i)}
    return sd


def bytes_per_token(arch: Qwen3MoeArch, scheme: str, context: int) -> float:
    """Bytes of weights (and KV cache) one decoded token reads at batch 1."""
    h, d, i, g = arch.hidden_size, arch.head_dim, arch.moe_intermediate_size, 128
    attn = (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads) * d * h
    expert = arch.num_experts_per_tok * 3 * i * h
    per_param = {"bf16": 2.0, "w4a16": 0.5 + 2.0 / g, "w8a8_int8": 1.0}[scheme]
    attn_b = attn * (1.0 if scheme == "w8a8_int8" else 2.0)
    router = arch.num_experts * h * 2
    norms = (2 * h + 2 * d) * 2
    kv = 2 * arch.num_key_value_heads * d * context * 2
    layer = attn_b + router + expert * per_param + norms + kv
    return arch.num_hidden_layers * layer + arch.vocab_size * h * 2 + h * 2 + h * 2


def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of reading a large fp32 tensor (a vectorised sum), best of ``reps``: what a decode step can hope
    for. (A bf16 sum is compute-bound on CPU, hence fp32.)"""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def engine_decode(model: Qwen3MoeEngineModel, batch: int, steps: int) -> float:
    """Decode tokens/s of the engine (scheduler, batched steps, greedy sampling) at ``batch`` sequences."""
    engine = Engine(EngineConfig(model_path="<random weights>", dtype="bfloat16", max_batch_size=16), model=model)
    try:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(4, model.arch.vocab_size, (batch, PROMPT_LEN), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
        done = threading.Semaphore(0)
        reqs = [engine.make_request(p, params, on_done=lambda r: done.release()) for p in prompts]
        for r in reqs:
            engine.submit(r)
        while any(not r.output_ids for r in reqs):  # prefills
            time.sleep(0.0005)
        t0, n0 = time.perf_counter(), sum(len(r.output_ids) for r in reqs)
        for _ in reqs:
            done.acquire()
        return (sum(len(r.output_ids) for r in reqs) - n0) / (time.perf_counter() - t0)
    finally:
        engine.shutdown()


def hf_model(sd: dict[str, torch.Tensor]):
    """transformers' Qwen3MoeForCausalLM in bf16 holding the same weights (experts stacked its way)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"}, eos_token_id=None,
                         pad_token_id=0, bos_token_id=None)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
    arch = Qwen3MoeArch.from_hf_config(CONFIG)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if ".experts." in name:
                ex = [f"model.layers.{name.split('.')[2]}.mlp.experts.{e}" for e in range(arch.num_experts)]
                if name.endswith("gate_up_proj"):
                    t.copy_(torch.stack([torch.cat([sd[f"{e}.gate_proj.weight"], sd[f"{e}.up_proj.weight"]])
                                         for e in ex]))
                else:
                    t.copy_(torch.stack([sd[f"{e}.down_proj.weight"] for e in ex]))
            elif name in sd:
                t.copy_(sd[name])
            elif "rotary" not in name:
                raise KeyError(name)
    model.model.rotary_emb.__init__(cfg)  # its buffers were lost on the meta device
    return model


class _StepClock:
    """A generate() streamer that timestamps every new token batch: decode time without the prefill."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model, batch: int, steps: int) -> float:
    """transformers' generate (bf16, greedy) decode tokens/s, timed from its first new token to its last."""
    ids = torch.randint(4, CONFIG["vocab_size"], (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                       attention_mask=torch.ones_like(ids), pad_token_id=0, streamer=clock)
    # put() is called with the prompt, then once per new token: times[1] = first new token
    return batch * steps / (clock.times[-1] - clock.times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per point (shared machines)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    arch = Qwen3MoeArch.from_hf_config(CONFIG)
    start = time.perf_counter()
    bw = measure_bandwidth()
    print(f"measured read bandwidth: {bw:.1f} GB/s ({args.threads} threads)", flush=True)
    sd = random_state_dict(arch)
    # Every model is built first and the measurements interleave (repeat > scheme > batch), best of the
    # repeats: on a shared machine the load drifts, and comparing schemes measured minutes apart misleads.
    runners = {"transformers": (hf_model(sd), hf_decode)}
    for scheme in ("bf16", "w4a16", "w8a8_int8"):
        tensors, qcfg = (sd, None) if scheme == "bf16" else export_state_dict(sd, QuantConfig(scheme=scheme))
        model = Qwen3MoeEngineModel(arch, tensors, qcfg, torch.bfloat16, slots=16,
                                    max_seq_len=CONFIG["max_position_embeddings"])
        runners[scheme] = (model, engine_decode)
        del tensors
    del sd
    gc.collect()
    print(f"models built in {time.perf_counter() - start:.0f} s", flush=True)
    for model, run in runners.values():
        run(model, 1, 2)  # warm-up
    results: dict[str, dict[int, float]] = {name: dict.fromkeys(BATCHES, 0.0) for name in runners}
    for rep in range(args.repeats):
        for name, (model, run) in runners.items():
            for b in BATCHES:
                results[name][b] = max(results[name][b], run(model, b, args.steps))
        bw = max(bw, measure_bandwidth(reps=2))
        print(f"repeat {rep + 1}: {results} ({time.perf_counter() - start:.0f} s)", flush=True)
    table = render(arch, results, bw, args)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table)
    print(f"wrote {OUT} in {time.perf_counter() - start:.0f} s")


def render(arch: Qwen3MoeArch, results: dict[str, dict[int, float]], bw: float, args) -> str:
    context = PROMPT_LEN + args.steps // 2
    base = bytes_per_token(arch, "bf16", context)
    lines = [
        "# Decode throughput of the embedded engine (benchmarks/decode.py)", "",
        f"Qwen3-30B-A3B-shaped slice: hidden 2048, 32/4 heads x 128, 128 experts x FFN 768, top-8, 2 layers, "
        f"vocab 4096 (small so lm_head does not dominate), random weights; prompt {PROMPT_LEN}, {args.steps} decode "
        f"steps, greedy, best of {args.repeats} runs; {args.threads} threads on "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, shared); compute dtype "
        f"bf16. Measured read bandwidth: **{bw:.1f} GB/s**. Bytes/token: weights read per decoded token at batch 1.",
        "",
        "| scheme | MB/token | allowed speedup | tok/s b=1 | tok/s b=4 | tok/s b=16 | speedup b=1 | % of allowed "
        "| GB/s b=1 | % of bandwidth |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scheme in ("bf16", "w4a16", "w8a8_int8"):
        r = results[scheme]
        nbytes = bytes_per_token(arch, scheme, context)
        allowed, achieved = base / nbytes, r[1] / results["bf16"][1]
        gbs = nbytes * r[1] / 1e9
        lines.append(f"| engine {scheme} | {nbytes / 1e6:.1f} | {allowed:.2f}x | {r[1]:.1f} | {r[4]:.1f} | "
                     f"{r[16]:.1f} | {achieved:.2f}x | {100 * achieved / allowed:.0f}% | {gbs:.1f} | "
                     f"{100 * gbs / bw:.0f}% |")
    r = results["transformers"]
    gbs = base * r[1] / 1e9
    lines.append(f"| transformers generate bf16 | {base / 1e6:.1f} | - | {r[1]:.1f} | {r[4]:.1f} | {r[16]:.1f} | "
                 f"- | - | {gbs:.1f} | {100 * gbs / bw:.0f}% |")
    e, t = results["bf16"], results["transformers"]
    lines += ["", "Engine bf16 / transformers generate: " + ", ".join(f"b={b}: {e[b] / t[b]:.2f}x" for b in BATCHES),
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
