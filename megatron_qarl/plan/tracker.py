"""The allocation tracker of the memory simulation (plan/simulate.py): the live bytes of the simulated device's
storages, by label, and their peak.

Labels say what allocated a storage. The persistent state: ``weights`` (parameters, DDP's parameter buffer),
``gradients`` (DDP's gradient buffers), ``optimizer`` (built or stepped by the optimizer: fp32 master, Adam's m
and v, its transient buffers), ``qat_cache`` (``FakeQuant``'s refresh). What a phase allocates, by kind
(``ACTIVATION_KINDS``): ``act_attention`` (the core attention: scores, probabilities, its inputs as it keeps
them), ``act_experts`` (the routed experts' GEMMs and SwiGLU), ``act_logits`` (the output layer and the
vocab-parallel cross entropy), ``comm_buffers`` (the MoE dispatcher's all-to-all outputs, and the weight sync's
gathers and buckets), ``act_checkpoint`` (the sharded state dicts a checkpoint save builds), ``act_layer``
(everything else of a forward / backward: norms, projections, router, permutation, the gradients in flight), and
``other`` (what was live before the measured phases that is none of these: rotary tables, RNG states, the batch).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator

import torch

PERSISTENT = ("weights", "gradients", "optimizer", "qat_cache")
ACTIVATION_KINDS = ("act_layer", "act_attention", "act_experts", "act_logits", "comm_buffers", "act_checkpoint",
                    "other")
LABELS = PERSISTENT + ACTIVATION_KINDS
ROUND_LARGE = 2 << 20  # PyTorch's caching allocator: an allocation of at least LARGE_ALLOC gets a segment rounded
LARGE_ALLOC = 10 << 20  # up to a multiple of 2 MiB (c10/cuda/CUDACachingAllocator.cpp kRoundLarge, kMinLargeAlloc)


def allocator_rounding(nbytes: int) -> int:
    """Bytes PyTorch's CUDA caching allocator reserves beyond ``nbytes`` for a fresh allocation: requests round up
    to 512 B; from 10 MiB on, the segment rounds up to 2 MiB (smaller ones share 2 MiB / 20 MiB segments, counted
    as no waste here). https://pytorch.org/docs/stable/notes/cuda.html#memory-management"""
    req = -(-nbytes // 512) * 512
    seg = -(-req // ROUND_LARGE) * ROUND_LARGE if req >= LARGE_ALLOC else req
    return seg - nbytes


class AllocationTracker:
    """Live bytes of the storages of the simulated device's tensors, in total and by label, and their peak."""

    def __init__(self) -> None:
        self.label = "other"
        self.live = 0
        self.by_label: dict[str, int] = defaultdict(int)
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._storages: dict[int, list] = {}  # storage key -> [nbytes, tensors holding it, label, (shape, dtype)]
        self.keep_peak_storages = False  # debugging: keep the live storages at each new peak (slow)
        self.peak_storages: list[tuple[int, str, tuple]] = []
        self.rounding = 0  # allocator_rounding of the live storages
        self.rounding_at_peak = 0

    def add(self, data: torch.Tensor, label: str | None = None) -> None:
        """A tensor the device holds: its storage counts from now until the last such tensor of it is gone. A new
        storage gets ``label``, by default the current one."""
        storage = data.untyped_storage()
        key = storage._cdata
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [storage.nbytes(), 0, label or self.label, (tuple(data.shape), data.dtype)]
            self.live += entry[0]
            self.rounding += allocator_rounding(entry[0])
            self.by_label[entry[2]] += entry[0]
            if self.live > self.peak:
                self.peak = self.live
                self.at_peak = dict(self.by_label)
                self.rounding_at_peak = self.rounding
                if self.keep_peak_storages:
                    self.peak_storages = self.largest(10**6)
        entry[1] += 1
        weakref.finalize(data, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.live -= entry[0]
            self.rounding -= allocator_rounding(entry[0])
            self.by_label[entry[2]] -= entry[0]

    def _entry(self, data: torch.Tensor) -> list | None:
        """The count of ``data``'s storage (a backing tensor), None where it is not counted."""
        return self._storages.get(data.untyped_storage()._cdata)

    def label_of(self, data: torch.Tensor) -> str | None:
        """The label of ``data``'s storage, None where it is not counted."""
        entry = self._entry(data)
        return entry[2] if entry is not None else None

    def holders(self, data: torch.Tensor) -> int:
        """How many live backing tensors hold ``data``'s storage (0 where it is not counted)."""
        entry = self._entry(data)
        return entry[1] if entry is not None else 0

    def relabel(self, tensors, label: str) -> None:
        """Move the storages of ``tensors`` (device tensors) to ``label``."""
        from megatron_qarl.gpu.simulated_device import SimTensor

        for t in tensors:
            data = t._data if isinstance(t, SimTensor) else t
            entry = self._entry(data)
            if entry is not None and entry[2] != label:
                self.by_label[entry[2]] -= entry[0]
                entry[2] = label
                self.by_label[label] += entry[0]

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Storages allocated inside the block get ``label`` (one of LABELS)."""
        if label not in LABELS:
            raise ValueError(f"label {label!r} is not one of {', '.join(LABELS)}")
        saved, self.label = self.label, label
        try:
            yield
        finally:
            self.label = saved

    def largest(self, n: int = 10, label: str | None = None) -> list[tuple[int, str, tuple]]:
        """The ``n`` largest live storages (of ``label``): (bytes, label, (shape, dtype) of the first tensor)."""
        rows = [(e[0], e[2], e[3]) for e in self._storages.values() if label is None or e[2] == label]
        return sorted(rows, key=lambda r: -r[0])[:n]

    def reset_peak(self) -> None:
        self.peak = self.live
        self.at_peak = dict(self.by_label)
        self.rounding_at_peak = self.rounding
        self.peak_storages = self.largest(10**6) if self.keep_peak_storages else []

    def phase_peak(self) -> dict[str, int]:
        """Bytes by label at the peak since ``reset_peak`` (every label of LABELS), with ``total`` = the peak and
        ``rounding`` = what the caching allocator would reserve beyond it (``allocator_rounding``, not in total)."""
        out = {k: self.at_peak.get(k, 0) for k in LABELS}
        out["total"] = self.peak
        out["rounding"] = self.rounding_at_peak
        return out
