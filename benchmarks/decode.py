"""Decode throughput of the embedded rollout engine per weight format, against transformers' generate.

Model: a Qwen3-30B-A3B-shaped slice with random weights made on the fly: hidden 2048, 32 query heads / 4 KV
heads of dim 128, 128 experts with FFN 768, top-8, 2 layers, vocab 4096 (kept small on purpose so that
lm_head, which stays BF16 in every scheme, does not dominate the bytes of a 2-layer slice).

Per scheme, the bytes of weights read per decoded token at batch 1 (attention + router + the top-8 experts
+ lm_head + one embedding row + norms + the KV cache at the mean context) give the speedup over BF16 that
memory bandwidth allows; we report the achieved speedup and the achieved GB/s against a read bandwidth
measured in the same run with the same thread count (an fp32 sum of 0.5-1 GiB, measured again just before
every batch-1 run). Decode time excludes the prefill: the clock starts when every sequence has its first
token.

Shared machines: every point is measured ``--repeats`` times, interleaved (repeat > scheme > batch) so that
a load change hits every scheme alike. Tokens/s columns keep the best run; speedups are the median of the
ratios taken within each repeat, and bandwidth fractions the median over batch-1 runs, each against the
bandwidth measured just before it. Each run also records the CPU stall
Linux reports in /proc/pressure/cpu ("some" total: time in which a runnable task of the machine waited
for a CPU) as a fraction of its wall time: ~0% means the machine was ours alone during that run.
OpenMP's static scheduling makes 2-thread runs collapse (10-100x) when another process takes a core, so
a high stall figure next to a slow 2-thread point explains it.

Four tables: (1) the GEMM kernels in isolation at one activation row (the decode case) streaming a weight
set larger than the caches: what each kernel this CPU runs can do (a kernel slower than 5 ms a call is timed
on a few calls only); (2) where the time of a batch-1 decode step goes (torch profiler: kernel calls vs
everything else); (3) decode tokens/s of the engine per scheme (BF16, W4A16, W8A8-INT8, W8A8-FP8) at batch 1,
4, 16 and of transformers' generate; (4) the engine's own check at load of each low-bit layer shape against
BF16 (serve/kernels/speed_check.py).

``--emulate-avx2`` reruns the benchmark with every library capped at AVX2 (torch: ATEN_CPU_CAPABILITY=avx2,
oneDNN: ONEDNN_MAX_CPU_ISA=AVX2, the engine's kernels: QARL_NATIVE_ISA=avx2): on an AVX-512 machine, what
an AVX2-only CPU (e.g. AMD EPYC Zen 2/3) runs, at this machine's speed per instruction.

    .venv/bin/python benchmarks/decode.py [--threads 1] [--steps 32] [--repeats 3] [--emulate-avx2] [--out FILE]

Prints the markdown and writes it to benchmarks/results/decode_t{threads}[_avx2].md (or --out). Memory: ~15 GB
at the peak on an AVX-512 machine (oneDNN's prepacked copies of the BF16, INT8 and FP8 weights), ~12 GB on an
AVX2 one; a machine with less free memory kills it (seen on the shared development VM).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import export_state_dict
from megatron_qarl.serve.engine import Engine, EngineConfig
from megatron_qarl.serve.kernels import native, speed_check
from megatron_qarl.serve.kernels.linear import INT4_INNER_K_TILES, PackedDense, _mkldnn_bf16, _onednn_int8
from megatron_qarl.serve.model import Qwen3MoeEngineModel
from megatron_qarl.serve.request import SamplingParams
from megatron_qarl.serve.weight_loading import in_fresh_thread

CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 2048, "num_hidden_layers": 2,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144, "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "max_position_embeddings": 256, "norm_topk_prob": True,
    "tie_word_embeddings": False, "attention_bias": False,
}
SCHEMES = ("bf16", "w4a16", "w8a8_int8", "w8a8_fp8")
EMULATE_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "QARL_NATIVE_ISA": "avx2"}
SLOW_CALL_S = 5e-3  # a kernel slower than this per call is timed on a few calls, one pass (a cliff, not a figure)
BATCHES = (1, 4, 16)
PROMPT_LEN = 16
RESULTS = Path(__file__).resolve().parent / "results"
KERNEL_PASSES = 7


# ------------------------------------------------------------------------------------------ the machine
def cpu_stall_us() -> int | None:
    """Cumulative microseconds in which some runnable task waited for a CPU (Linux PSI), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None


def timed(fn: Callable[[], object]) -> tuple[float, float | None]:
    """(wall seconds, CPU stall fraction during them) of one call."""
    s0, t0 = cpu_stall_us(), time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    s1 = cpu_stall_us()
    return dt, (None if s0 is None or s1 is None else (s1 - s0) / 1e6 / dt)


def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of reading a large fp32 tensor (a vectorised sum), best of ``reps``: what a decode step can hope
    for. (A bf16 sum is compute-bound on CPU, hence fp32.)"""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = min(timed(x.sum)[0] for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------------------- the model
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
    per_param = {"bf16": 2.0, "w4a16": 0.5 + 2.0 / g, "w8a8_int8": 1.0, "w8a8_fp8": 1.0 + 4.0 / g / g}[scheme]
    attn_b = attn * (per_param if scheme.startswith("w8a8") else 2.0)  # W8A8 quantizes attention too
    router = arch.num_experts * h * 2
    norms = (2 * h + 2 * d) * 2
    kv = 2 * arch.num_key_value_heads * d * context * 2
    layer = attn_b + router + expert * per_param + norms + kv
    return arch.num_hidden_layers * layer + arch.vocab_size * h * 2 + h * 2 + h * 2


# ------------------------------------------------------------------------------- (1) kernels in isolation
def kernel_table(bw: float) -> list[str]:
    """GB/s of weight bytes each GEMM kernel streams at one activation row, over weights > the caches."""
    shapes = {"expert gate_up 1536x2048": (1536, 2048), "expert down 2048x768": (2048, 768),
              "attention qkv 5120x2048": (5120, 2048)}
    rows = []
    for label, (n, k) in shapes.items():
        rows += _kernel_rows(label, n, k, bw)
        gc.collect()
    return rows


def _kernel_set(n: int, k: int, copies: int) -> dict[str, tuple[Callable[[int], object], float]]:
    """name -> (call on weight copy j, weight bytes) for every kernel this CPU runs at one activation row."""
    g = torch.Generator().manual_seed(n + k)
    w = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16)
    sz = torch.stack([torch.rand(k // 128, n) * 0.01, torch.zeros(k // 128, n)], -1).to(torch.bfloat16)
    codes8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for _ in range(copies)]
    s8 = torch.rand(n, dtype=torch.bfloat16) * 0.01
    kernels: dict[str, tuple[Callable[[int], object], float]] = {
        "bf16 F.linear (what transformers runs)": (lambda j: F.linear(x, w[j]), n * k * 2)}
    if _mkldnn_bf16():  # oneDNN's bf16 kernels need AVX512-BF16 / AVX-NE-CONVERT
        packed = [PackedDense(t) for t in w]
        kernels["bf16 oneDNN prepacked (engine bf16)"] = (lambda j: packed[j](x), n * k * 2)
    int4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32),
                                                                INT4_INNER_K_TILES) for _ in range(copies)]
    kernels["int4 torch _weight_int4pack_mm_for_cpu"] = (
        lambda j: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4[j], 128, sz), n * k * 0.5 + sz.numel() * 2)
    kernels["int8 weight-only _weight_int8pack_mm"] = (lambda j: torch.ops.aten._weight_int8pack_mm(x, codes8[j], s8),
                                                       n * k)
    if _onednn_int8():
        q8 = [torch.ops.onednn.qlinear_prepack(c, None) for c in codes8]
        u8, s8f, z8 = torch.randint(0, 256, (1, k), dtype=torch.uint8), s8.float(), torch.zeros(n, dtype=torch.int64)
        kernels["int8 oneDNN u8s8 qlinear"] = (lambda j: torch.ops.onednn.qlinear_pointwise(
            u8, 0.01, 128, q8[j], s8f, z8, None, 1.0, 0, torch.bfloat16, "none", [], ""), n * k)
    lib = native.load()
    if lib is None:
        return kernels
    words = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g) for _ in range(copies)]
    s4 = sz[..., 0].t().contiguous()  # bf16 [N, K/G]
    f8 = [c.view(torch.uint8) for c in codes8]  # int8 bytes read as e4m3 codes: their values do not matter
    s_fp8 = torch.rand(-(-n // 128), k // 128, generator=g) * 0.01
    for isa in lib.isas("int4")[:-1]:  # in the engine one call takes all k experts of a token
        kernels[f"int4 native {isa}"] = (lambda j, isa=isa: lib.int4(x, [words[j]], [s4], 128, torch.bfloat16, isa=isa),
                                         n * k * 0.5 + s4.numel() * 2)
    for isa in lib.isas("int8")[:-1]:  # quantizes the bf16 activation itself
        kernels[f"int8 native {isa}"] = (lambda j, isa=isa: lib.int8(x, [codes8[j]], [s8.float()], torch.bfloat16,
                                                                       isa=isa), n * k)
    for isa in lib.isas("fp8")[:-1]:
        kernels[f"fp8 native {isa}"] = (lambda j, isa=isa: lib.fp8(x, [f8[j]], [s_fp8], 128, torch.bfloat16, isa=isa),
                                        n * k)
    return kernels


def _kernel_rows(label: str, n: int, k: int, bw: float) -> list[str]:
    copies = max(8, int(320e6 // (n * k * 2)))  # > 300 MB of bf16 weights: no cache reuse across calls
    kernels = _kernel_set(n, k, copies)
    best = {name: (float("inf"), 0.0) for name in kernels}
    probe = {name: timed(lambda call=call: call(0))[0] for name, (call, _) in kernels.items()}
    for p in range(KERNEL_PASSES):  # interleaved passes, best of them: a load change hits every kernel alike
        for name, (call, _) in kernels.items():
            slow = probe[name] > SLOW_CALL_S
            if slow and p:
                continue
            calls = 3 if slow else copies
            call(0)
            dt, st = timed(lambda call=call, calls=calls: [call(j) for j in range(calls)])
            if dt / calls < best[name][0]:
                best[name] = (dt / calls, st or 0.0)
    rows = []
    for name, (_, nbytes) in kernels.items():
        per_call, stall = best[name]
        gbs = nbytes / per_call / 1e9
        note = " (3 calls)" if probe[name] > SLOW_CALL_S else ""
        rows.append(f"| {label} | {name}{note} | {per_call * 1e6:.0f} | {gbs:.1f} | {100 * gbs / bw:.0f}% | "
                    f"{100 * stall:.0f}% |")
        print(rows[-1], flush=True)
    return rows


# --------------------------------------------------------------------------- (2) where a step goes
GEMM_OPS = ("mkldnn::_linear_pointwise", "onednn::qlinear_pointwise", "aten::_weight_int4pack_mm_for_cpu",
            "aten::_weight_int8pack_mm", "aten::mm", "aten::addmm", "native low-bit GEMV")


def step_profile(name: str, model: Qwen3MoeEngineModel, arch: Qwen3MoeArch, context: int) -> str:
    """Batch-1 decode steps under the torch profiler: kernel-call time vs the rest."""
    g = torch.Generator().manual_seed(0)
    model.forward(torch.randint(4, arch.vocab_size, (1, PROMPT_LEN), generator=g), torch.tensor([0]),
                  torch.arange(PROMPT_LEN)[None])
    tok = torch.tensor([[5]])
    steps = range(PROMPT_LEN, PROMPT_LEN + 8)
    for p in steps:  # warm
        model.forward(tok, torch.tensor([0]), torch.tensor([[p]]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for p in steps:
            model.forward(tok, torch.tensor([0]), torch.tensor([[p]]))
        wall = (time.perf_counter() - t0) / len(steps)
    ka = prof.key_averages()
    n = len(steps)
    gemm = sum(e.self_cpu_time_total for e in ka if e.key in GEMM_OPS) / n / 1e3
    calls = sum(e.count for e in ka if e.key in GEMM_OPS) / n
    ops = sum(e.self_cpu_time_total for e in ka) / n / 1e3
    count = sum(e.count for e in ka) / n
    gbs = bytes_per_token(arch, name, context) / (gemm / 1e3) / 1e9
    return (f"| {name} | {wall * 1e3:.2f} | {gemm:.2f} ({100 * gemm / (wall * 1e3):.0f}%) | {calls:.0f} | {gbs:.1f} | "
            f"{ops - gemm:.2f} | {count - calls:.0f} | {wall * 1e3 - ops:.2f} |")


# ------------------------------------------------------------------------------------- (3) decode
def engine_decode(model: Qwen3MoeEngineModel, batch: int, steps: int) -> tuple[float, float | None]:
    """(decode tokens/s, stall) of the engine (scheduler, batched steps, greedy sampling) at ``batch``."""
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
        n0 = sum(len(r.output_ids) for r in reqs)
        dt, stall = timed(lambda: [done.acquire() for _ in reqs])
        return (sum(len(r.output_ids) for r in reqs) - n0) / dt, stall
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
        self.stalls: list[int | None] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        self.stalls.append(cpu_stall_us())

    def end(self) -> None:
        pass


def hf_decode(model, batch: int, steps: int) -> tuple[float, float | None]:
    """transformers' generate (bf16, greedy) decode tokens/s, timed from its first new token to its last; on
    a fresh thread, as the engine's steps run on the engine's fresh thread."""
    return in_fresh_thread(_hf_decode, model, batch, steps)


def _hf_decode(model, batch: int, steps: int) -> tuple[float, float | None]:
    ids = torch.randint(4, CONFIG["vocab_size"], (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                       attention_mask=torch.ones_like(ids), pad_token_id=0, streamer=clock)
    # put() is called with the prompt, then once per new token: times[1] = first new token
    dt = clock.times[-1] - clock.times[1]
    s0, s1 = clock.stalls[1], clock.stalls[-1]
    return batch * steps / dt, (None if s0 is None or s1 is None else (s1 - s0) / 1e6 / dt)


def return_freed_memory() -> None:
    """A fixed mmap threshold for glibc malloc: a freed tensor goes back to the OS. (By default the threshold
    grows to 32 MiB after the first large frees, later tensors of a few MiB land on the heap, and the heap
    keeps their pages after they are freed: building these models then peaks at over 20 GB.)"""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def build_runners(arch: Qwen3MoeArch) -> dict:
    """transformers' model and one engine model per scheme, all from the same random weights. transformers'
    model is filled from the BF16 engine's store (the same tensors by HF name) after the random weights are
    dropped: 2.4 GB less at the peak (~15 GB on an AVX-512 machine, where oneDNN holds prepacked copies)."""
    sd = random_state_dict(arch)
    runners = {}
    for scheme in (*SCHEMES[1:], SCHEMES[0]):  # bf16 last: its model takes the random weights' place
        tensors, qcfg = (sd, None) if scheme == "bf16" else export_state_dict(sd, QuantConfig(scheme=scheme))
        model = Qwen3MoeEngineModel(arch, tensors, qcfg, torch.bfloat16, slots=16,
                                    max_seq_len=CONFIG["max_position_embeddings"])
        runners[scheme] = (model, engine_decode)
        del tensors
    del sd
    gc.collect()
    return {"transformers": (hf_model(runners["bf16"][0].store), hf_decode), **{s: runners[s] for s in SCHEMES}}


def main() -> None:
    return_freed_memory()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved runs per point (tokens/s: the best; ratios: the median)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/decode_t{threads}.md, with _avx2 before .md where the engine's "
                         "best kernels are AVX2 (an AVX2 machine, or --emulate-avx2), _plain without native ones")
    ap.add_argument("--skip-kernels", action="store_true", help="leave out table (1)")
    ap.add_argument("--emulate-avx2", action="store_true",
                    help="cap torch, oneDNN and the engine's kernels at AVX2 (" +
                         " ".join(f"{k}={v}" for k, v in EMULATE_AVX2.items()) + ")")
    args = ap.parse_args()
    if args.emulate_avx2 and any(os.environ.get(k) != v for k, v in EMULATE_AVX2.items()):
        sys.exit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, **EMULATE_AVX2}))
    torch.set_num_threads(args.threads)
    out = args.out or RESULTS / f"decode_t{args.threads}{_results_suffix()}.md"
    arch = Qwen3MoeArch.from_hf_config(CONFIG)
    context = PROMPT_LEN + args.steps // 2
    start = time.perf_counter()
    # All torch work of this process runs on short-lived threads (in_fresh_thread) and the engine's own
    # thread: a thread that ran a parallel op keeps an OpenMP team until it exits, and with more teams than
    # cores libgomp stops spinning between GEMMs (2x slower decode at 2 threads; see in_fresh_thread).
    bws = [in_fresh_thread(measure_bandwidth)]
    print(f"measured read bandwidth: {bws[0]:.1f} GB/s ({args.threads} threads)", flush=True)
    kernel_rows = [] if args.skip_kernels else in_fresh_thread(kernel_table, bws[0])
    runners = in_fresh_thread(build_runners, arch)
    gc.collect()
    print(f"models built in {time.perf_counter() - start:.0f} s", flush=True)
    for model, run in runners.values():
        run(model, 1, 2)  # warm-up
    # The measurements interleave (repeat > scheme > batch): on a shared machine the load drifts (and on this
    # VM so does the memory bandwidth the host gives us), so ratios are taken within a repeat, between runs
    # seconds apart, and every batch-1 run is paired with a bandwidth measured just before it.
    runs: list[dict] = []  # one per (repeat, runner, batch)
    for rep in range(args.repeats):
        for name, (model, run) in runners.items():
            for b in BATCHES:
                bw_now = in_fresh_thread(measure_bandwidth, gib=0.5, reps=2) if b == 1 else None
                tps, stall = run(model, b, args.steps)
                runs.append({"rep": rep, "name": name, "b": b, "tps": tps, "stall": stall or 0.0, "bw": bw_now})
                if bw_now:
                    bws.append(bw_now)
        print(f"repeat {rep + 1}: " + "; ".join(
            f"{n} " + ", ".join(f"{r['tps']:.1f}" for r in runs if r["rep"] == rep and r["name"] == n) for n in runners)
              + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    profile_rows = [in_fresh_thread(step_profile, s, runners[s][0], arch, context) for s in SCHEMES]
    text = render(arch, runs, bws, kernel_rows, profile_rows, args, time.perf_counter() - start)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")


def best_kernels() -> dict[str, str]:
    """The engine's native kernel per format (int8, int4, fp8) that this machine runs first; {} without the library."""
    lib = native.load()
    return {f: lib.isas(f)[0] for f in ("int8", "int4", "fp8")} if lib else {}


def isa_line() -> str:
    """Which instruction sets each library runs here (and what capped them)."""
    kern = ", ".join(f"{f} {isa}" for f, isa in best_kernels().items()) or "none (not built)"
    caps = " ".join(f"{k}={os.environ[k]}" for k in EMULATE_AVX2 if k in os.environ)
    return (f"Instruction sets: torch CPU capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 kernels "
            f"{'yes' if _mkldnn_bf16() else 'no'}, engine native kernels: {kern}" +
            (f" (capped: `{caps}`)." if caps else "."))


def _results_suffix() -> str:
    """What the default results file is named after: the engine's best native kernels on this machine ("" for
    AVX-512, "_avx2", "_plain" without native kernels), so that one machine's run never overwrites another's."""
    best = set(best_kernels().values())
    return "" if any(i.startswith("avx512") for i in best) else "_avx2" if "avx2" in best else "_plain"


def speed_check_rows() -> list[str]:
    """Table (4): the engine's load-time check of each low-bit layer shape against BF16."""
    rows = []
    for (fmt, one, many, n, k, _, counts), res in speed_check.RESULTS.items():
        cells = " | ".join(f"{r}: {res[r][0] * 1e6:.0f} / {res[r][1] * 1e6:.0f} ({res[r][0] / res[r][1]:.2f}x)"
                           if r in res else f"{r}: -" for r in counts)
        rows.append(f"| {fmt} | {n}x{k} | {one} | {many} | {cells} |")
    return rows


def render(arch, runs, bws, kernel_rows, profile_rows, args, seconds) -> str:
    context = PROMPT_LEN + args.steps // 2
    base = bytes_per_token(arch, "bf16", context)
    stalls = [r["stall"] for r in runs]
    cmd = " ".join(["benchmarks/decode.py", *sys.argv[1:]])

    def pick(name, b, rep=None):
        return [r for r in runs if r["name"] == name and r["b"] == b and (rep is None or r["rep"] == rep)]

    lines = [
        f"# Decode throughput of the embedded engine, {args.threads} thread(s)", "",
        f"Command: `.venv/bin/python {cmd}` ({seconds / 60:.0f} min, torch {torch.__version__}, "
        f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}`).",
        f"Machine: {cpu_name()}, {os.cpu_count()} logical CPUs of a VM (other tenants of its host are invisible "
        "to it), "
        f"{args.threads} torch thread(s). Read bandwidth (fp32 sum of 0.5-1 GiB, {args.threads} thread(s)), "
        f"measured {len(bws)} times in this run, once before every batch-1 run: {min(bws):.1f}-{max(bws):.1f} GB/s "
        f"(median {median(bws):.1f}); it moves with the host's load, which the VM does not see. CPU stall (PSI: "
        f"share of wall time some task of this VM waited for a CPU) over all decode runs: median "
        f"{100 * median(stalls):.0f}%, max {100 * max(stalls):.0f}%.", "", isa_line(), "",
        "Model: Qwen3-30B-A3B-shaped slice, hidden 2048, 32/4 heads x 128, 128 experts x FFN 768, top-8, "
        f"2 layers, vocab 4096, random weights; prompt {PROMPT_LEN}, {args.steps} greedy decode steps; "
        f"{args.repeats} interleaved repeats; compute dtype bf16.", "",
    ]
    if kernel_rows:
        lines += ["## (1) GEMM kernels in isolation, one activation row", "",
                  "Each kernel called over a rotating set of > 300 MB of weights (no cache reuse); best of "
                  f"{KERNEL_PASSES} interleaved passes; % of the bandwidth measured at the start; stall: during the "
                  "pass kept.", "",
                  "| weight | kernel | us/call | GB/s of weight bytes | % of bandwidth | stall |",
                  "|---|---|---|---|---|---|", *kernel_rows, ""]
    lines += ["## (2) Where a batch-1 decode step goes (torch profiler, 8 steps, after the repeats)", "",
              "| scheme | ms/step | in GEMM kernels | kernel calls | GB/s while in kernels | other ops ms | "
              "other ops | Python + dispatch ms |", "|---|---|---|---|---|---|---|---|", *profile_rows, "",
              "## (3) Decode tokens/s", "",
              "MB/token: weights (and KV cache) read per decoded token at batch 1. Allowed speedup: the BF16 bytes "
              "over the scheme's. tok/s: best of the repeats. Speedup b=1: median over repeats of the scheme's "
              "tok/s over BF16's in the same repeat (min-max in brackets). % of bandwidth: median over repeats of "
              "MB/token x tok/s over the bandwidth measured just before that run.", "",
              "| scheme | MB/token | allowed speedup | tok/s b=1 | tok/s b=4 | tok/s b=16 | speedup b=1 | "
              "% of allowed | % of bandwidth b=1 | stall b=1 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name in (*SCHEMES, "transformers"):
        scheme = "bf16" if name == "transformers" else name
        nbytes = bytes_per_token(arch, scheme, context)
        best = {b: max(r["tps"] for r in pick(name, b)) for b in BATCHES}
        ratios = [pick(name, 1, k)[0]["tps"] / pick("bf16", 1, k)[0]["tps"] for k in range(args.repeats)]
        frac = median([nbytes * r["tps"] / 1e9 / r["bw"] for r in pick(name, 1)])
        stall = median([r["stall"] for r in pick(name, 1)])
        label = "transformers generate bf16" if name == "transformers" else f"engine {name}"
        if name == "transformers":
            speed, allowed_s, of_allowed = f"{median(ratios):.2f}x", "-", "-"
        else:
            allowed = base / nbytes
            speed = f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            allowed_s, of_allowed = f"{allowed:.2f}x", f"{100 * median(ratios) / allowed:.0f}%"
        lines.append(f"| {label} | {nbytes / 1e6:.1f} | {allowed_s} | {best[1]:.1f} | {best[4]:.1f} | {best[16]:.1f} | "
                     f"{speed} | {of_allowed} | {100 * frac:.0f}% | {100 * stall:.0f}% |")

    def vs_hf(b: int) -> float:
        reps = range(args.repeats)
        return median([pick("bf16", b, k)[0]["tps"] / pick("transformers", b, k)[0]["tps"] for k in reps])

    ratios = ", ".join(f"b={b}: {vs_hf(b):.2f}x" for b in BATCHES)
    lines += ["", f"Engine bf16 / transformers generate (median of within-repeat ratios): {ratios}", ""]
    lines += ["## (4) The engine's check at load: each low-bit layer shape against BF16 "
              "(serve/kernels/speed_check.py)", "",
              "The layer's forward (activation quantization included) vs the dense GEMM of a bf16 weight of the same "
              "shape, at the row counts decode gives it (attention 1 and 16, a routed expert 1 and 2); one thread, "
              "weights out of the caches, best of up to 10 calls; rows: us low-bit / us dense (ratio).", "",
              "| scheme | N x K | kernel, 1 row | kernel, rows | 1 row | more rows |", "|---|---|---|---|---|---|",
              *speed_check_rows(), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
