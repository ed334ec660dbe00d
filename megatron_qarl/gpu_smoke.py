"""The GPU machine check behind scripts/gpu_smoke.sh (``python -m megatron_qarl.gpu_smoke report|smoke``).

``report``: what this machine offers (CUDA devices, NCCL, Transformer Engine and its FP8 block-scale format,
SGLang, the torch.distributed backend the learner would pick). ``smoke``: every check it can run there, sized for a
short lease on one GPU (about a minute of work on an H200 for the tiny model):

- ``fp8_gemm``: FP8 GEMMs on the tensor cores: SGLang's block recipe (1 x 128 activation groups, 128 x 128 weight
  blocks, fp32 scales) computed from our quantizer's codes with ``torch._scaled_mm`` per 128-wide K block, against
  the same operands dequantized and multiplied in fp32; with Transformer Engine also TE's Float8BlockScaling GEMM of
  the same bf16 operands, against the bf16 product and against the SGLang-recipe result.
- ``learner_step[impl,scheme]``: a TP1/EP1 ``Learner`` on CUDA (NCCL world size 1) for each quant scheme (bf16,
  w4a16, w8a8_fp8, w8a8_int8): load the tiny model, the aligned forward, one optimizer step; impl "local" always,
  "te" too where Transformer Engine is installed (its GEMMs in BF16 on ModelOpt's fake-quant operands for the
  quantized schemes, w8a8_fp8 too: docs/quantization.md, "FP8 on the TE spec").
- ``sync_payload_nccl[impl,scheme]``: that learner's weight-sync payload (``sync.payload.iter_sync_tensors``, what a
  sync sends SGLang), every tensor broadcast over an NCCL group of world size 1, which rejects CPU tensors as a real
  weight-update group does; the failures name the tensors.
- ``nccl_broadcast``: a 4 MiB NCCL broadcast from GPU 0 to every visible GPU (one process each).

On a machine without CUDA it says so and exits 0. The GPU code it checks lives with its concept: the Transformer
Engine model in ``moe/te.py`` (built by ``moe.model.build_model(..., te=True)``), the backend choice in
``moe/parallelize.py``, the SGLang command in ``rollout/sglang_launcher.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from megatron_qarl.qat.config import SCHEMES, QuantConfig

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "checkpoints" / "tiny-qwen3-moe"
NO_CUDA = "skipped: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check"


def report() -> dict[str, Any]:
    """What this machine offers: CUDA devices, NCCL, Transformer Engine, SGLang."""
    import torch

    from megatron_qarl.moe.parallelize import dist_backend
    from megatron_qarl.moe.te import prefer_fp32_block_scales, te_fp8_block_scales, transformer_engine_available
    from megatron_qarl.rollout.sglang_launcher import sglang_available

    prefer_fp32_block_scales()  # before anything imports TE, as in a learner process
    cuda = torch.cuda.is_available()
    te = transformer_engine_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "nccl": bool(cuda and torch.distributed.is_nccl_available()),
        "transformer_engine": te,
        "te_fp8_block_scales": te_fp8_block_scales() if te else None,
        "sglang": sglang_available(),
        "backend": dist_backend(),
    }


# ---------------------------------------------------------------------------------------------------- FP8 GEMMs
def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _fp8_gemm(te: bool) -> dict[str, float]:
    """SGLang's block-FP8 GEMM from our codes on the tensor cores (torch._scaled_mm), and TE's when installed."""
    import torch

    from megatron_qarl.qat.quantizer import (
        dequant_act_fp8_per_token_group,
        dequantize_fp8_block,
        quant_act_fp8_per_token_group,
        quantize_fp8_block,
    )

    torch.manual_seed(0)
    m, n, k, b = 256, 512, 1024, 128
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    qw = quantize_fp8_block(w, b)
    qa, sa = quant_act_fp8_per_token_group(x, b)
    ref = dequant_act_fp8_per_token_group(qa, sa, torch.float32) @ dequantize_fp8_block(qw, torch.float32).t()
    one = torch.ones((), device="cuda", dtype=torch.float32)
    out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
    s_w = qw.scales.repeat_interleave(b, dim=0)[:n]  # [N, K/B]: each output row's block scale per K block
    for kb in range(k // b):
        a_blk = qa[:, kb * b:(kb + 1) * b].contiguous()
        w_blk = qw.codes[:, kb * b:(kb + 1) * b].contiguous().t()  # [B, N], column-major as _scaled_mm wants
        part = torch._scaled_mm(a_blk, w_blk, scale_a=one, scale_b=one, out_dtype=torch.float32)
        out += part * sa[:, kb:kb + 1] * s_w[:, kb][None, :]
    torch.cuda.synchronize()
    result = {"scaled_mm_vs_fp32_dequant_rel": _rel(out, ref)}
    if result["scaled_mm_vs_fp32_dequant_rel"] > 1e-3:
        raise RuntimeError(f"block-FP8 GEMM from our codes differs from the dequantized product: {result}")
    if te:
        import transformer_engine.pytorch as te_pt
        from transformer_engine.common.recipe import Float8BlockScaling

        lin = te_pt.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            lin.weight.copy_(w)
        autocast = getattr(te_pt, "autocast", None)
        ctx = (autocast(enabled=True, recipe=Float8BlockScaling()) if autocast is not None
               else te_pt.fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling()))
        with torch.no_grad(), ctx:
            y = lin(x)
        torch.cuda.synchronize()
        result["te_block_fp8_vs_bf16_rel"] = _rel(y, x.float() @ w.float().t())
        result["te_block_fp8_vs_sglang_recipe_rel"] = _rel(y, out)
        if result["te_block_fp8_vs_bf16_rel"] > 0.1:
            raise RuntimeError(f"TE's block-FP8 GEMM is far from the bf16 product: {result}")
    return result


# ------------------------------------------------------------------------------------ learner step + sync payload
def _learner_checks(impl: str, scheme: str, checks: dict[str, str]) -> None:
    """One CUDA learner (TP1/EP1) for ``scheme``: its step, then its sync payload over NCCL (two check entries)."""
    import torch
    import torch.distributed as dist

    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner import Batch, Learner, token_mean_nll
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import broadcast
    from megatron_qarl.sync.payload import iter_sync_tensors

    key = f"[{impl},{scheme}]"
    learner = None
    try:
        t0 = time.perf_counter()
        arch = Qwen3MoeArch.from_model_dir(TINY_MODEL)
        learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-4), dtype=torch.bfloat16,
                          quant=QuantConfig(scheme=scheme), aligned=True, impl=impl)
        learner.load_hf(str(TINY_MODEL))
        if learner.device.type != "cuda":
            raise RuntimeError(f"the learner's parameters are on {learner.device}, not CUDA")
        torch.manual_seed(0)
        seq = 128  # FP8 GEMMs want token counts in multiples of 16 (TE blockwise: 128)
        tokens = torch.randint(0, arch.vocab_size, (4, seq))
        mask = torch.ones(4, seq - 1)
        logp = learner.forward_logprobs(tokens)
        total = int(mask.sum())
        metrics = learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, total))
        torch.cuda.synchronize()
        if not (torch.isfinite(logp).all() and metrics["skipped"] == 0.0):
            raise RuntimeError(f"non-finite step: {metrics}")
        checks["learner_step" + key] = (f"ok: loss {metrics['loss']:.4f}, grad_norm {metrics['grad_norm']:.4f}, "
                                        f"mean logp {float(logp.mean()):.4f}, {time.perf_counter() - t0:.1f}s")
    except Exception as err:  # noqa: BLE001 - report every check, then fail at the end
        checks["learner_step" + key] = f"FAILED: {type(err).__name__}: {err}"
        checks["sync_payload_nccl" + key] = "skipped: the learner step failed"
        return
    try:
        group = dist.new_group(ranks=[0], backend="nccl")
        sent, nbytes, refused = 0, 0, []
        for name, tensor in iter_sync_tensors(learner):
            try:
                broadcast(tensor, src=0, group=group, name=name)  # the device check, then NCCL itself
                sent, nbytes = sent + 1, nbytes + tensor.numel() * tensor.element_size()
            except Exception as err:  # noqa: BLE001 - name every tensor NCCL refuses
                refused.append(f"{name} ({tensor.device}: {type(err).__name__})")
        torch.cuda.synchronize()
        dist.destroy_process_group(group)
        if refused:
            raise RuntimeError(f"{len(refused)} of {sent + len(refused)} tensors refused: {refused[:4]}")
        checks["sync_payload_nccl" + key] = f"ok: {sent} tensors, {nbytes / 2**20:.2f} MiB"
    except Exception as err:  # noqa: BLE001
        checks["sync_payload_nccl" + key] = f"FAILED: {type(err).__name__}: {err}"
    finally:
        del learner
        torch.cuda.empty_cache()


def _learner_all(impls: list[str], checks: dict[str, str]) -> None:
    from megatron_qarl.moe.parallelize import destroy_parallel, free_port, init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    init_parallel(tp=1, ep=1)
    try:
        for impl in impls:
            for scheme in SCHEMES:
                _learner_checks(impl, scheme, checks)
    finally:
        destroy_parallel()


def _broadcast_rank(rank: int, world: int, port: int, q) -> None:
    import torch
    import torch.distributed as dist

    from megatron_qarl.moe.parallelize import broadcast, to_group_device

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = to_group_device(torch.full((1 << 20,), float(rank == 0) * 3.0))
        broadcast(t, 0, name="smoke tensor")
        torch.cuda.synchronize()
        q.put((rank, float(t.min()), float(t.max())))
    finally:
        dist.destroy_process_group()


def _nccl_broadcast() -> dict[str, Any]:
    """A 4 MiB NCCL broadcast from GPU 0 to every visible GPU (one process each; 1 GPU: a group of one)."""
    import torch
    import torch.multiprocessing as mp

    from megatron_qarl.moe.parallelize import free_port

    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    results = sorted(q.get(timeout=5) for _ in range(world))
    if any(p.exitcode != 0 for p in procs) or any((lo, hi) != (3.0, 3.0) for _, lo, hi in results):
        raise RuntimeError(f"NCCL broadcast failed: exit codes {[p.exitcode for p in procs]}, got {results}")
    return {"ranks": world, "bytes": 4 << 20}


def smoke() -> dict[str, Any]:
    """Run every check this machine can; each result is "ok: ...", "skipped: why" or "FAILED: error"."""
    info = report()
    out: dict[str, Any] = {"machine": info}
    if not info["cuda"]:
        out["checks"] = {"all": NO_CUDA}
        return out
    checks: dict[str, str] = {}

    def run(name, fn, *args):
        t0 = time.perf_counter()
        try:
            checks[name] = f"ok: {fn(*args)}, {time.perf_counter() - t0:.1f}s"
        except Exception as err:  # noqa: BLE001 - report every check, then fail at the end
            checks[name] = f"FAILED: {type(err).__name__}: {err}"

    te = info["transformer_engine"]
    run("fp8_gemm", _fp8_gemm, te)
    impls = ["local", "te"] if te else ["local"]
    try:
        _learner_all(impls, checks)
    except Exception as err:  # noqa: BLE001 - e.g. the process group cannot form
        checks["learner"] = f"FAILED: {type(err).__name__}: {err}"
    if not te:
        checks["learner_step[te,*]"] = "skipped: transformer_engine not installed (the local spec ran)"
    run("nccl_broadcast", _nccl_broadcast)
    checks["sglang"] = "ok: importable" if info["sglang"] else "skipped: sglang not installed"
    out["checks"] = checks
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_qarl.gpu_smoke", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["report", "smoke"])
    args = parser.parse_args(argv)
    if args.command == "report":
        print(json.dumps(report(), indent=2))
        return 0
    t0 = time.perf_counter()
    result = smoke()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2), flush=True)
    return 1 if any(str(v).startswith("FAILED") for v in result["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
