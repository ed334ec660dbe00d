"""The GPU machine check behind scripts/gpu_smoke.sh (``python -m megatron_qarl.gpu_smoke report|smoke``).

``report``: what this machine offers (CUDA devices, NCCL, Transformer Engine, SGLang, the torch.distributed
backend the learner would pick). ``smoke``: every check it can run there: one CUDA Megatron train step of the
tiny model (local spec, then Transformer Engine spec and TE FP8 when TE is installed) and an NCCL broadcast over
the visible GPUs; on a machine without CUDA it says so and exits 0.

The GPU code it checks lives with its concept: the Transformer Engine model in ``moe/te.py`` (built by
``moe.model.build_model(..., te=quant)``), the backend choice in ``moe/parallelize.py``, the SGLang command in
``rollout/sglang_launcher.py``, the NCCL/gloo socket variables of a Slurm job in ``megatron_qarl/launch/slurm.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from megatron_qarl.qat.config import QuantConfig

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "checkpoints" / "tiny-qwen3-moe"


def report() -> dict[str, Any]:
    """What this machine offers: CUDA devices, NCCL, Transformer Engine, SGLang."""
    import torch

    from megatron_qarl.moe.parallelize import dist_backend
    from megatron_qarl.moe.te import transformer_engine_available
    from megatron_qarl.rollout.sglang_launcher import sglang_available

    cuda = torch.cuda.is_available()
    return {
        "cuda": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "nccl": bool(cuda and torch.distributed.is_nccl_available()),
        "transformer_engine": transformer_engine_available(),
        "sglang": sglang_available(),
        "backend": dist_backend(),
    }


# --------------------------------------------------------------------------------------------- smoke
def _megatron_step(te: bool, fp8: bool) -> dict[str, float]:
    """One Adam step of the tiny Qwen3-MoE as a Megatron GPTModel on GPU 0 (world size 1, NCCL)."""
    import torch
    import torch.nn.functional as F

    from megatron_qarl.moe.model import Qwen3MoeArch, build_model, causal_mask
    from megatron_qarl.moe.parallelize import destroy_parallel, free_port, init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    init_parallel(tp=1, ep=1)
    try:
        arch = Qwen3MoeArch.from_model_dir(TINY_MODEL)
        quant = QuantConfig(scheme="w8a8_fp8" if fp8 else "bf16")
        # te False: the local spec, as on CPU
        model = build_model(arch, dtype=torch.bfloat16, te=quant if te else None).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        torch.manual_seed(0)
        seq = 128  # FP8 GEMMs want dimensions that are multiples of 16
        tokens = torch.randint(0, arch.vocab_size, (2, seq), device="cuda")
        pos = torch.arange(seq, device="cuda").unsqueeze(0).expand_as(tokens)
        mask = causal_mask(seq).cuda()
        losses = []
        for _ in range(2):
            logits = model(tokens, pos, mask)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        torch.cuda.synchronize()
        if not all(x == x and abs(x) < 1e4 for x in losses):
            raise RuntimeError(f"non-finite loss {losses}")
        return {"loss_first": losses[0], "loss_second": losses[1]}
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
        p.join(timeout=300)
    results = sorted(q.get(timeout=5) for _ in range(world))
    if any(p.exitcode != 0 for p in procs) or any((lo, hi) != (3.0, 3.0) for _, lo, hi in results):
        raise RuntimeError(f"NCCL broadcast failed: exit codes {[p.exitcode for p in procs]}, got {results}")
    return {"ranks": world, "bytes": 4 << 20}


def smoke() -> dict[str, Any]:
    """Run every check this machine can; each result is "ok: ...", "skipped: why" or "FAILED: error"."""
    info = report()
    out: dict[str, Any] = {"machine": info}
    if not info["cuda"]:
        out["checks"] = {"all": "skipped: no CUDA device"}
        return out
    checks = {}

    def run(name, fn, *args):
        try:
            checks[name] = f"ok: {fn(*args)}"
        except Exception as err:  # noqa: BLE001 - report every check, then fail at the end
            checks[name] = f"FAILED: {type(err).__name__}: {err}"

    run("megatron_cuda_step", _megatron_step, False, False)
    run("nccl_broadcast", _nccl_broadcast)
    if info["transformer_engine"]:
        run("megatron_te_step", _megatron_step, True, False)
        run("megatron_te_fp8_step", _megatron_step, True, True)
    else:
        checks["megatron_te_step"] = "skipped: transformer_engine not installed"
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
    result = smoke()
    print(json.dumps(result, indent=2))
    return 1 if any(str(v).startswith("FAILED") for v in result["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
