"""Weight-sync bytes and seconds, W4A16 vs BF16: a Megatron learner (one gloo rank) pushes its weights to one
embedded server (`qarl serve`, a separate process) with the DistributedBroadcaster, as the trainer does.

Per model and scheme: the learner loads the checkpoint (W4A16: with its fake quant, whose one quantizer
makes the codes it sends), the server starts from the matching checkpoint (W4A16: made by qat/'s export),
then ``--syncs`` syncs run back to back. Before each, the learner's quantization cache is dropped, as an
optimizer step does, so a W4A16 sync includes quantizing the experts (the learner's real cost after a
step). Reported per sync: bytes sent, wall seconds of the whole cycle (pause, flush, buckets of
update request + broadcasts, server-side load, continue), and apart from it the seconds the learner needs
to produce the payload (names, casts, quantization; no transport), measured on its own. The first sync
also creates the weight-update group; it is reported apart. The last sync runs in verify mode: the
server's checksums of what it holds must equal the bytes sent.

Models: the project's tiny checkpoint and a Qwen3-30B-A3B-shaped slice with random weights (hidden 2048,
32/4 heads x 128, FFN 768, top-8, 2 layers, vocab 4096) with 32 of the 128 experts (the learner keeps fp32
weights, gradients and Adam state on this machine's memory).

    .venv/bin/python benchmarks/sync.py [--syncs 3] [--threads 1] [--models tiny,slice]

Writes benchmarks/results/sync.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import free_port, init_parallel, run_ranks
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import quantize_checkpoint
from megatron_qarl.rollout.process import ServerProcess, embedded_command
from megatron_qarl.sync.broadcaster import DistributedBroadcaster, Engine
from megatron_qarl.sync.payload import iter_sync_tensors

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny-qwen3-moe"
OUT = Path(__file__).resolve().parent / "results" / "sync.md"
SLICE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 2048,
    "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 32, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 256, "norm_topk_prob": True,
    "tie_word_embeddings": False, "attention_bias": False, "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def write_slice(out: Path) -> Path:
    """A random bf16 Hugging Face checkpoint of the slice (values do not matter for sync throughput)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**{k: v for k, v in SLICE.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    tensors = {}
    for name, p in model.state_dict().items():
        if "rotary" in name:
            continue
        tensors[name] = (torch.ones(p.shape) if "norm" in name else torch.randn(p.shape) * 0.02).to(torch.bfloat16)
    # transformers 5 stacks experts: write the per-expert names the checkpoint format (and qat/ export) uses
    flat = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                flat[f"{p}{e}.gate_proj.weight"], flat[f"{p}{e}.up_proj.weight"] = gate.contiguous(), up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            p = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                flat[f"{p}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            flat[name] = t
    out.mkdir(parents=True, exist_ok=True)
    save_file(flat, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(SLICE, indent=1))
    return out


def start_server(model_dir: Path, threads: int, log: Path) -> ServerProcess:
    port = free_port()
    server = ServerProcess(embedded_command(str(model_dir), port, max_batch_size=2, max_seq_len=64),
                           f"http://127.0.0.1:{port}", log, env={"OMP_NUM_THREADS": str(threads)},
                           startup_timeout_s=600)
    server.start()
    return server


def measure(model_dir: str, scheme: str, url: str, syncs: int, threads: int) -> dict:
    """One gloo rank: learner + broadcaster; returns the per-sync figures."""
    from megatron_qarl.learner.rank import Learner

    torch.set_num_threads(threads)
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel()
    quant = QuantConfig(scheme="w4a16") if scheme == "w4a16" else None
    learner = Learner(arch, ParallelConfig(), OptimConfig(), quant=quant, aligned=quant is not None)
    learner.load_hf(model_dir)
    payload = []
    for _ in range(syncs):
        if learner.fake_quant:
            learner.fake_quant.invalidate()
        t0 = time.perf_counter()
        n = sum(t.numel() * t.element_size() for _, t in iter_sync_tensors(learner, torch.bfloat16))
        payload.append(time.perf_counter() - t0)
    sync = DistributedBroadcaster([Engine(url)], dtype=torch.bfloat16)
    reports = []
    for i in range(syncs + 2):  # the first (creates the group), `syncs` timed, one in verify mode
        if learner.fake_quant:
            learner.fake_quant.invalidate()
        sync.verify = i == syncs + 1
        reports.append(sync.sync(learner))
    sync.close()
    assert reports[-1].checksums, "verify mode returned no checksums"
    return {"payload_bytes": n, "payload_s": payload, "first_s": reports[0].seconds,
            "sync_s": [r.seconds for r in reports[1:-1]], "bytes": reports[1].bytes, "tensors": reports[1].tensors,
            "buckets": reports[1].buckets, "verified": len(reports[-1].checksums)}


def server_apply_seconds(served: Path, threads: int) -> float:
    """The server's share of a sync, measured in this process: load every tensor of the checkpoint into an
    engine model that holds it (in-place copies + re-derived kernel operands: int4 repack, oneDNN prepack),
    best of 2."""
    from megatron_qarl.qat.export import iter_safetensors
    from megatron_qarl.serve.model import Qwen3MoeEngineModel

    torch.set_num_threads(threads)
    model = Qwen3MoeEngineModel.from_model_dir(served, torch.bfloat16, 2, 64)
    tensors = dict(iter_safetensors(served))
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        model.update_tensors(tensors)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner and of the server")
    ap.add_argument("--models", default="tiny,slice")
    args = ap.parse_args()
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"tiny": TINY}
        if "slice" in args.models:
            dirs["slice"] = write_slice(Path(tmp) / "slice")
        for model in args.models.split(","):
            base = dirs[model]
            for scheme in ("bf16", "w4a16"):
                served = base if scheme == "bf16" else quantize_checkpoint(base, "w4a16", Path(tmp) / f"{model}-w4a16")
                server = start_server(Path(served), args.threads, Path(tmp) / "server.log")
                try:
                    r = run_ranks(1, measure, str(base), scheme, server.url, args.syncs, args.threads)[0]
                finally:
                    server.stop()
                r.update(model=model, scheme=scheme, apply_s=server_apply_seconds(Path(served), args.threads))
                rows.append(r)
                print(json.dumps(r), flush=True)
    text = render(rows, args, time.perf_counter() - start)
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")


def render(rows: list[dict], args, seconds: float) -> str:
    def med(xs):
        return sorted(xs)[len(xs) // 2]

    cmd = " ".join(["benchmarks/sync.py", *sys.argv[1:]])
    lines = [
        "# Weight sync, W4A16 vs BF16: learner -> one embedded server (benchmarks/sync.py)", "",
        f"Command: `.venv/bin/python {cmd}` ({seconds / 60:.0f} min). One learner rank (Megatron, gloo, fp32 "
        f"weights) and one `qarl serve --dtype bfloat16` process on the same machine, {args.threads} torch "
        "thread(s) each, broadcast over gloo on loopback, buckets of 512 MiB. Per sync: median of "
        f"{args.syncs} syncs after the first (which also creates the group). Payload: the learner producing "
        "every tensor of a sync alone (casts, W4A16 quantization of the experts), no transport. Server load: "
        "an engine model loading the same tensors in place (copies + int4 repack / oneDNN prepack), no transport. "
        "The rest of a sync is the HTTP cycle and the gloo broadcast.", "",
        "| model | scheme | tensors | MB sent | vs BF16 | s / sync | first sync s | payload s | server load s | "
        "MB/s | verified tensors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bf16 = {r["model"]: r["bytes"] for r in rows if r["scheme"] == "bf16"}
    for r in rows:
        s = med(r["sync_s"])
        lines.append(f"| {r['model']} | {r['scheme']} | {r['tensors']} | {r['bytes'] / 1e6:.2f} | "
                     f"{r['bytes'] / bf16[r['model']]:.2f}x | {s:.2f} | {r['first_s']:.2f} | "
                     f"{med(r['payload_s']):.2f} | {r['apply_s']:.2f} | {r['bytes'] / 1e6 / s:.0f} | {r['verified']} |")
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
