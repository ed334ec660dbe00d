"""What both ends of SGLang's HTTP protocol share: dtype names, response bodies, and the process group of
the distributed weight update. The trainer side (sync/weight_update.py, sync/transport.py, rollout/client.py) and
the server side (serve/weight_receiver.py) both import it; neither imports the other.
``DTYPES`` is the project's one table of dtype names (configs name dtypes by these too).

dtype names are SGLang's: ``getattr(torch, name)`` (its weight receiver), and ``str(dtype)`` without the
``torch.`` prefix on the sending side.

The update group: a trainer (rank 0) and every rollout engine rank form a group through ``tcp://addr:port``; the engine
must not touch the process's default group (a test or a colocated learner may own it), so the group
is built as SGLang's ``init_custom_process_group`` does: rendezvous on the URL, a store prefixed with
the group name, then torch's ``_new_process_group_helper`` (the function ``init_process_group`` calls
for the default group), and the rank map registered so ``dist.broadcast(..., group=pg)`` works.
The trainer side of a test or of our own broadcaster calls the same function with rank 0.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

# SGLang's answers to /update_weights_from_distributed that come after the whole bucket was received (its
# model_runner.update_weights_from_distributed, and the flush that follows): the broadcast left nothing pending
LOAD_FAILED = "Failed to update parameter online"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64",
                 "float8_e4m3fn", "bool")
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> ``"bfloat16"`` (the name SGLang's receiver passes to ``getattr(torch, name)``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} has no SGLang name here; known: {', '.join(DTYPES)}")
    return name


def response_body(r) -> Any:
    """An httpx response's body: JSON, the text of the answers SGLang sends as plain text (/flush_cache,
    /health), or None when empty."""
    if not r.content:
        return None
    try:
        return r.json()
    except ValueError:
        return r.text


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> torch.bfloat16; ValueError naming the valid ones."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[key]


# The weight-update group's own timeout stands this far above the sync's deadline (rollout.sync.timeout_s): NCCL starts
# an op's clock when it is enqueued, before the trainer takes its deadline, and with TORCH_NCCL_ASYNC_ERROR_HANDLING at
# its default the watchdog ends the process when that clock runs out; the margin lets the trainer's deadline fire
# first, raise its SyncError naming the servers and destroy the group (docs/cluster.md, "Every wait is bounded")
GROUP_MARGIN_S = 60.0


def group_timeout_s(sync_timeout_s: float) -> float:
    """The weight-update group's timeout, on both ends: rollout.sync.timeout_s + GROUP_MARGIN_S."""
    return sync_timeout_s + GROUP_MARGIN_S


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float = 300.0,
    rendezvous_s: float | None = None,
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) a process group that is not the default one; blocks until all join (within
    ``rendezvous_s``, default ``timeout_s``); its collectives wait ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    meet = timedelta(seconds=timeout_s if rendezvous_s is None else rendezvous_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=meet))
    store.set_timeout(meet)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg: dist.ProcessGroup) -> None:
    """Leave ``pg`` (never the default group)."""
    dist.destroy_process_group(pg)
