"""Weight changes of the embedded engine: loads from disk, buckets of a weight-update session (full or delta), their
finalization, and the weight version the engine reports, with the per-request version events SGLang records.

Every change takes the engine's lock, so it lands between two engine steps. The HTTP endpoints that call these are
serve/weight_receiver.py's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from megatron_qarl.serve.model import Qwen3MoeEngineModel
from megatron_qarl.serve.request import Request

T = TypeVar("T")


def in_fresh_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a short-lived thread (exceptions re-raised here).

    Why: torch's CPU ops run on OpenMP (libgomp), which keeps a team of worker threads for every thread that
    ever ran a parallel op, until that thread exits. Once libgomp manages more threads than there are CPUs
    it stops spinning between parallel regions and puts workers to sleep after ~100 spins, so every GEMM of
    a decode step pays a futex wake-up: measured on 2 cores, a prepacked bf16 GEMV took 100 us instead of
    50 us on the engine thread after the main thread had built the model. So the heavy one-off work
    (building the model, loading a weight update) runs on a thread that exits and frees its team, and the
    engine thread keeps the only team of the process.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            box["error"] = err

    thread = threading.Thread(target=run, name="qarl-engine-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[return-value]


class WeightLoader:
    """The model's weight changes under ``lock``; ``version`` names the held weights (SGLang's weight_version).
    ``live`` lists the requests not yet finished (their version events are recorded at each change)."""

    def __init__(self, model: Qwen3MoeEngineModel, lock: threading.RLock, live: Callable[[], list[Request]]):
        self.model, self.lock, self.live = model, lock, live
        self.version = "default"

    def update_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str | None) -> None:
        """Load and finalize at once (an update from disk)."""
        self._update(lambda: in_fresh_thread(self.model.update_tensors, tensors), weight_version)

    def load_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str | None) -> None:
        """Load one bucket of a weight-update session; the low-bit layers are rebuilt at ``finalize``."""
        self._update(lambda: self.model.load_tensors(tensors), weight_version)

    def apply_deltas(self, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], weight_version: str | None) -> None:
        """Apply one bucket of a delta sync in place (``Qwen3MoeEngineModel.apply_deltas``); finalized at
        ``finalize`` like a loaded bucket."""
        self._update(lambda: self.model.apply_deltas(parts), weight_version)

    def set_version(self, weight_version: str) -> None:
        """Name the held weights ``weight_version`` without changing them (SGLang's /update_weight_version)."""
        self._update(lambda: None, weight_version)

    def finalize(self) -> int:
        """End of a weight-update session: repack / prepack what was loaded (returns the linears rebuilt)."""
        with self.lock:
            return in_fresh_thread(self.model.finalize_weights)

    def _update(self, change: Callable[[], None], weight_version: str | None) -> None:
        """A weight change between two engine steps; the version moves only once it succeeded. As SGLang's
        ``record_weight_version_change`` (scheduler.py), every live request with output records the version
        its tokens so far were sampled with (``Request.version_events``)."""
        with self.lock:
            change()
            if weight_version is not None and weight_version != self.version:
                for req in self.live():
                    if req.output_ids:
                        req.version_events.append((self.version, len(req.output_ids)))
                self.version = weight_version
