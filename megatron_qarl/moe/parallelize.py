"""Process groups: the torch.distributed backend (``dist_backend``: NCCL on GPUs, gloo on CPU) of the learner and
of the weight-update group, the learner's Megatron tensor / expert parallel groups, and a helper that starts N local
ranks for commands and tests.

Every collective of the package goes through this module (tests/test_collectives.py checks that no other module calls
torch.distributed's). ``group_device(group)`` is the one answer to "which device do this group's tensors live on"
(the current CUDA device for NCCL, the CPU for gloo; NCCL refuses CPU tensors even in a group of one);
``to_group_device`` / ``group_empty`` put a tensor there, and the wrappers (``all_gather_tensors``, ``broadcast``,
``all_reduce``, ``barrier``) refuse, naming it, a tensor on another device. With ``QARL_STRICT_DEVICES=1`` (the
test suite sets it) they also refuse a tensor that ``to_group_device`` / ``group_empty`` did not place, so a CPU-only
run catches the tensor that would reach NCCL from the CPU on a GPU machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import time
import traceback
import weakref
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


STRICT_ENV = "QARL_STRICT_DEVICES"

# the tensors to_group_device / group_empty placed, by id (a torch tensor hashes by id; the entry goes with the tensor)
_PLACED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class DeviceError(RuntimeError):
    """A tensor handed to a collective is not on its group's device, or (strict mode) was not placed there by
    ``to_group_device``; the message names it."""


def strict_devices() -> bool:
    """Strict mode: the collectives refuse tensors that this module's helpers did not place (``QARL_STRICT_DEVICES``
    set and not 0; the test suite turns it on)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def group_device(group=None) -> torch.device:
    """The device whose tensors ``group`` (None: the default group) communicates: the current CUDA device for an
    NCCL group, the CPU for gloo. Nothing else in the package picks a collective's device."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _placed(t: torch.Tensor) -> torch.Tensor:
    _PLACED[id(t)] = t
    return t


def to_group_device(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` on ``group``'s device (``t`` itself when it is there already), marked as placed for the collectives."""
    return _placed(t.to(group_device(group)))


def group_empty(shape, dtype: torch.dtype, group=None) -> torch.Tensor:
    """An uninitialised buffer on ``group``'s device (a receive buffer), marked as placed."""
    return _placed(torch.empty(shape, dtype=dtype, device=group_device(group)))


def _check(t: torch.Tensor, group, name: str) -> None:
    """DeviceError naming ``name`` unless ``t`` is on ``group``'s device (and, strict, was placed there by this
    module)."""
    want = group_device(group)
    if t.device != want:
        raise DeviceError(f"{name}: a {t.device} tensor handed to a collective of a {dist.get_backend(group)} group, "
                          f"whose tensors live on {want} (place it with parallelize.to_group_device)")
    if strict_devices() and _PLACED.get(id(t)) is not t:
        raise DeviceError(f"{name}: a {t.dtype} {list(t.shape)} tensor on {t.device} handed to a collective was not "
                          f"placed by parallelize.to_group_device ({STRICT_ENV}=1): on a GPU machine it may be a CPU "
                          "tensor that NCCL refuses")


def all_gather_tensors(t: torch.Tensor, group, size: int, name: str = "tensor") -> list[torch.Tensor]:
    """Collective over ``group`` (``size`` ranks): every rank's ``t`` (same shape and dtype, on the group's device), in
    rank order. ``size`` 1 returns ``[t]`` without communicating (after the same device check)."""
    _check(t, group, name)
    if size == 1:
        return [t]
    out = [_placed(torch.empty_like(t)) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


# gloo has no float8 type (its broadcast raises "Invalid scalar type"): those go as their bytes, a uint8 view of the
# same storage, so a receive still fills the float8 buffer (NCCL takes float8 as it is)
_BYTES_ON_GLOO = (torch.float8_e4m3fn, torch.float8_e5m2)


def broadcast(t: torch.Tensor, src: int, group=None, async_op: bool = False, name: str = "tensor"):
    """``dist.broadcast`` of ``t`` (on ``group``'s device) from ``src``; with ``async_op`` the work handle. On a gloo
    group a float8 tensor travels as its bytes (``_BYTES_ON_GLOO``)."""
    _check(t, group, name)
    if t.dtype in _BYTES_ON_GLOO and "gloo" in str(dist.get_backend(group)):
        t = t.view(torch.uint8)
    return dist.broadcast(t, src=src, group=group, async_op=async_op)


def all_reduce(t: torch.Tensor, group=None, name: str = "tensor") -> None:
    """In-place sum of ``t`` (on ``group``'s device) over ``group``."""
    _check(t, group, name)
    dist.all_reduce(t, group=group)


def barrier(group=None) -> None:
    """``dist.barrier`` on ``group``; NCCL's is told the current device rather than guessing one from the rank."""
    device = group_device(group)
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


# launch.collective_timeout_s's default: how long a collective of the learner's groups waits for its peers
COLLECTIVE_TIMEOUT_S = 300.0

# the variables torch's ProcessGroupNCCL reads for what a timed-out collective does, each with its legacy name
# (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp), and their defaults
NCCL_ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # int, 3 SkipCleanUp
NCCL_BLOCKING_WAIT = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")  # bool, false
_TRUE, _FALSE = ("y", "yes", "1", "t", "true"), ("n", "no", "0", "f", "false")


def _torch_env(environ, names: tuple[str, str]) -> tuple[str, str] | None:
    """(name, value) of the variable torch reads for ``names``: the first name where set, else the legacy second one
    (c10d Utils.hpp ``getCvarInt`` / ``getCvarBool`` read them in reverse order, so the first wins); None if neither."""
    for name in names:
        if name in environ:
            return name, environ[name]
    return None


def nccl_timeout_problem(environ) -> str | None:
    """Why an NCCL collective that outlives its group's timeout would not fail in a process with ``environ``, as
    torch reads it: async error handling off (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, or the legacy
    ``NCCL_ASYNC_ERROR_HANDLING``, = 0) without blocking wait (``TORCH_NCCL_BLOCKING_WAIT`` / ``NCCL_BLOCKING_WAIT``
    true): the watchdog then only logs it and the ranks wait on. A value torch refuses is a problem too (it fails the
    group's creation). None when a timed-out collective fails."""
    handling, blocking = _torch_env(environ, NCCL_ASYNC_ERROR_HANDLING), _torch_env(environ, NCCL_BLOCKING_WAIT)
    if handling is not None and not handling[1].strip().lstrip("-").isdigit():
        return f"{handling[0]}={handling[1]!r} is not an integer (torch refuses it when it creates an NCCL group)"
    if blocking is not None and blocking[1].lower() not in _TRUE + _FALSE:
        return f"{blocking[0]}={blocking[1]!r} is neither true nor false (torch refuses it)"
    if handling is None or int(handling[1]) != 0 or (blocking is not None and blocking[1].lower() in _TRUE):
        return None
    first = NCCL_ASYNC_ERROR_HANDLING[0]
    legacy = f" (torch's legacy name of {first})" if handling[0] != first else ""
    return (f"{handling[0]}={handling[1]}{legacy} without {NCCL_BLOCKING_WAIT[0]}: an NCCL collective past its "
            "timeout is only logged, its ranks wait on")


def init_parallel(*, tp: int = 1, ep: int = 1, seed: int = 1234, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the default process group (env:// variables) and create Megatron's parallel groups. Every group gets
    ``timeout_s`` (launch.collective_timeout_s) exactly: a collective whose peers do not all join within it raises,
    on gloo and NCCL alike, instead of waiting on torch's or NCCL's own defaults. Megatron takes whole minutes
    (``distributed_timeout_minutes``, rounded up here) and creates its expert-data-parallel gloo group with none
    (gloo's 30 minutes), so every group it lists (``parallel_state._global_process_group_list``: the default group
    as None, and this rank's groups) is then set to ``timeout_s`` (``set_group_timeouts``)."""
    import datetime
    import math

    from megatron_qarl.moe.te import prefer_fp32_block_scales

    prefer_fp32_block_scales()  # before Megatron imports Transformer Engine (it reads the variable on import)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_qarl.moe import megatron_cpu
    from megatron_qarl.moe.model import expert_tp

    megatron_cpu.apply()
    if not dist.is_initialized():
        backend = dist_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % tp or world % ep:
        raise ValueError(f"world size {world} is not divisible by tp={tp} and ep={ep}")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=expert_tp(tp, ep),
                                 distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
    set_group_timeouts(learner_groups(), timeout_s)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def set_group_timeouts(groups: list, timeout_s: float) -> None:
    """Every op a group of ``groups`` starts from now on waits ``timeout_s`` at most (torch's ``_set_pg_timeout``, the
    call Megatron's own ``update_pg_timeout`` makes: the backend's default timeout, which gloo reads per op and NCCL
    gives each work it enqueues)."""
    import datetime

    for group in groups:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)


def learner_groups() -> list:
    """This rank's learner groups: the default group and every group Megatron created (its process-group list)."""
    from megatron.core import parallel_state as ps

    return [dist.distributed_c10d._get_default_group() if g is None else g
            for g in (ps._global_process_group_list or [None])]


@contextlib.contextmanager
def collective_timeout(timeout_s: float, restore_s: float):
    """Every learner group (``learner_groups``) waits ``timeout_s`` inside the block, ``restore_s`` after it: the
    checkpoint's collectives (launch.checkpoint_timeout_s), which wait for the slowest rank's writes."""
    groups = learner_groups()
    set_group_timeouts(groups, timeout_s)
    try:
        yield
    finally:
        set_group_timeouts(groups, restore_s)


@dataclasses.dataclass(frozen=True)
class SyncGroups:
    """The weight sync's own groups (``sync_groups``): the learner's world and this rank's tensor-, expert-tensor- and
    expert-parallel groups' ranks, each a group of its own whose collectives wait the sync's peer bound."""

    world: Any
    tp: Any
    etp: Any
    ep: Any


_SYNC_GROUPS: dict[float, SyncGroups] = {}  # by timeout; forgotten by destroy_parallel


def sync_groups(timeout_s: float) -> SyncGroups | None:
    """The weight sync's groups with ``timeout_s`` (None in a world of one, where no collective communicates).
    Made on first use, collectively (every learner rank calls this at the same point of its first sync): every rank's
    TP / ETP / EP group ranks are all-gathered over the default group and each distinct group made anew in one order
    on every rank (``dist.new_group`` is collective over the world). Their collectives are the sync's only: the ranks
    other than 0 wait in them while rank 0 talks to the servers, a wait bounded by the sync's own key
    (rollout.sync.timeout_s, sync/transport.py ``peer_wait_s``) rather than launch.collective_timeout_s."""
    import datetime

    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if timeout_s in _SYNC_GROUPS:
        return _SYNC_GROUPS[timeout_s]
    mine = {"tp": ps.get_tensor_model_parallel_group(), "etp": ps.get_expert_tensor_parallel_group(),
            "ep": ps.get_expert_model_parallel_group()}
    ranks = {key: tuple(dist.get_process_group_ranks(g)) for key, g in mine.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    timeout = datetime.timedelta(seconds=timeout_s)
    made = {"world": dist.new_group(list(range(dist.get_world_size())), timeout=timeout)}
    for key in mine:
        for group_ranks in sorted({e[key] for e in everyone}):
            group = dist.new_group(list(group_ranks), timeout=timeout)
            if dist.get_rank() in group_ranks:
                made[key] = group
    _SYNC_GROUPS[timeout_s] = SyncGroups(**made)
    return _SYNC_GROUPS[timeout_s]


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    _SYNC_GROUPS.clear()
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, conn, env: dict, cwd: str) -> None:
    # a forkserver child inherits the server's environment and directory, not the caller's: restore the caller's
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        # plain pickle: torch's multiprocessing pickler would share tensors through file
        # descriptors that vanish when this process exits
        conn.send(("ok", pickle.dumps(fn(*args))))
    except BaseException as err:  # report, don't hang the parent
        conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def single_rank_env() -> None:
    """The env:// variables of a world of one rank in this process, on a free local port."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")


# modules every rank imports (torch, Megatron-Core, ModelOpt, the learner): a forkserver imports them once per
# process and forks ranks from it, instead of each spawned rank importing them again (about 5 s of CPU per rank)
RANK_PRELOAD = ["megatron_qarl.learner.rank"]


def rank_context():
    """The multiprocessing context of local ranks: forkserver with RANK_PRELOAD imported on CPU-only machines;
    spawn where CUDA is available (a process that may hold a CUDA context is never forked)."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` local processes joined in one gloo group; return per-rank
    results (rank order). ``fn`` must be picklable (a module-level function). Ranks see this process's
    environment and working directory (``rank_context``). Every wait is bounded by ``timeout``: each rank answers
    on a pipe of its own, whose only writer is that rank, so a rank that dies (even half-way through its answer)
    is an end of file here, never a read that waits for bytes that will not come."""
    from multiprocessing.connection import wait

    if world == 1:
        single_rank_env()
        try:
            return [fn(*args)]
        finally:
            destroy_parallel()
    ctx = rank_context()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs, pending = [], {}
    for r in range(world):
        recv, send = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_entry, args=(r, world, port, fn, args, send, env, cwd)))
        procs[-1].start()
        send.close()  # the rank holds the only write end
        pending[recv] = r
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while pending:
        ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for conn in ready:
            rank = pending.pop(conn)
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                procs[rank].join(timeout=5)
                errors.append(f"rank {rank}: exited (code {procs[rank].exitcode}) without a result")
                continue
            finally:
                conn.close()
            (results.__setitem__(rank, pickle.loads(value)) if status == "ok" else
             errors.append(f"rank {rank}: {value}"))
    for conn in pending:
        conn.close()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    if len(results) < world:
        raise RuntimeError(f"only {len(results)} of {world} ranks finished (timeout {timeout:.0f}s or crash)")
    return [results[r] for r in range(world)]
