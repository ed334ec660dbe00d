"""Process groups: the torch.distributed backend (``dist_backend``: NCCL on GPUs, gloo on CPU) of the learner and
of the weight-update group, the learner's Megatron tensor / expert parallel groups, the one all-gather helper the
shard-gathering code uses, and a helper that starts N local ranks for commands and tests."""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_backend() -> str:
    """torch.distributed backend of the learner's process group and of the weight-update group: nccl with CUDA,
    else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def all_gather_tensors(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Collective over ``group`` (``size`` ranks): every rank's ``t`` (same shape and dtype), in rank order.
    ``size`` 1 returns ``[t]`` without communicating."""
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def init_parallel(*, tp: int = 1, ep: int = 1, seed: int = 1234) -> None:
    """Join the default process group (env:// variables) and create Megatron's parallel groups."""
    from megatron_qarl.moe.te import prefer_fp32_block_scales

    prefer_fp32_block_scales()  # before Megatron imports Transformer Engine (it reads the variable on import)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_qarl import megatron_cpu
    from megatron_qarl.moe.model import expert_tp

    megatron_cpu.apply()
    if not dist.is_initialized():
        backend = dist_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    if world % tp or world % ep:
        raise ValueError(f"world size {world} is not divisible by tp={tp} and ep={ep}")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=expert_tp(tp, ep))
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        # plain pickle: torch's multiprocessing pickler would share tensors through file
        # descriptors that vanish when this process exits
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException as err:  # report, don't hang the parent
        queue.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` local processes joined in one gloo group; return per-rank
    results (rank order). ``fn`` must be picklable (a module-level function)."""
    if world == 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        try:
            return [fn(*args)]
        finally:
            destroy_parallel()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, status, value = queue.get()
        (results.__setitem__(rank, pickle.loads(value)) if status == "ok" else errors.append(f"rank {rank}: {value}"))
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    if len(results) < world:
        raise RuntimeError(f"only {len(results)} of {world} ranks finished (timeout {timeout:.0f}s or crash)")
    return [results[r] for r in range(world)]
