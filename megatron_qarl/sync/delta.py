"""Delta weight sync: send only the blocks of a checkpoint-format tensor that changed since the last sync.

A tensor T of n elements of s bytes is cut into n / b blocks of b consecutive elements (C order), b | n.
Between the server's copy T_old and the learner's T_new (compared bit for bit, so -0.0 != +0.0 and every
NaN payload counts):

    C_b      = { j : T_new[j*b : (j+1)*b] != T_old[j*b : (j+1)*b] }          the changed blocks
    wire(b)  = |C_b| * (b * s + s_idx),   s_idx = 4 (int32 index) if n / b < 2^31 else 8 (int64)
    full     = n * s

The encoder picks, per tensor and per sync, the b of least wire(b) among 1 (one element: an int32 word of
8 int4 codes, one scale, one bf16 weight), every power of two dividing the row length (a W4A16 group of 128
codes is b = 16 words), the row length, and n (the whole tensor: one block). An unchanged tensor is not
sent at all. BENCHMARKS.md ("Delta weight sync") measures what each fixed granularity would have cost.

On the wire (the broadcaster's usual bucketed /update_weights_from_distributed + broadcast, with
``load_format="delta"``), a changed tensor ``name`` becomes two tensors, always in the same bucket:

    name + ".delta_index"   int32 (or int64) [k]     the sorted, distinct changed block numbers j
    name + ".delta_values"  T's dtype       [k, b]   T_new's blocks j, in the index's order

and the server applies ``T.view(n / b, b)[index] = values`` in place (``apply``), so
``apply(T_old, diff(T_old, T_new)) == T_new`` bit for bit whatever b was chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

INDEX = ".delta_index"
VALUES = ".delta_values"
LOAD_FORMAT = "delta"
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bitwise views by element size


@dataclasses.dataclass(frozen=True)
class Delta:
    """The changed blocks of tensor ``name``: ``index`` [k] block numbers, ``values`` [k, b]."""

    name: str
    index: Tensor
    values: Tensor

    @property
    def block(self) -> int:
        return int(self.values.shape[1])

    def wire(self) -> list[tuple[str, Tensor]]:
        """The two tensors that go on the wire, under their derived names."""
        return [(self.name + INDEX, self.index), (self.name + VALUES, self.values)]


def index_dtype(blocks: int) -> torch.dtype:
    """int32 while the block numbers fit (n / b < 2^31), else int64."""
    return torch.int32 if blocks < 2**31 else torch.int64


def changed_mask(old: Tensor, new: Tensor) -> Tensor:
    """Flat bool [n]: element i of ``new`` differs from ``old`` in any bit."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"cannot diff {old.dtype} {list(old.shape)} against {new.dtype} {list(new.shape)}")
    kind = _INT[old.element_size()]
    return old.contiguous().reshape(-1).view(kind) != new.contiguous().reshape(-1).view(kind)


def changed_elements(old: Tensor, new: Tensor) -> Tensor:
    """int64 [k]: the sorted flat positions of the elements that differ (one pass over the tensors; every
    block size is then counted from these k positions alone)."""
    return changed_mask(old, new).nonzero().squeeze(1)


def block_numbers(elements: Tensor, block: int) -> Tensor:
    """The sorted, distinct numbers j of the blocks of ``block`` elements holding the changed ``elements``."""
    blocks = elements // block
    if blocks.numel() < 2:
        return blocks
    first = torch.ones_like(blocks, dtype=torch.bool)
    first[1:] = blocks[1:] != blocks[:-1]
    return blocks[first]


def candidate_blocks(shape: torch.Size | tuple[int, ...]) -> list[int]:
    """Block sizes tried for a tensor of this shape: 1, powers of two dividing the row, the row, the tensor."""
    n = 1
    for d in shape:
        n *= int(d)
    row = int(shape[-1]) if len(shape) else 1
    out, b = [1], 2
    while b < row and row % b == 0:
        out.append(b)
        b *= 2
    return sorted({*out, max(row, 1), max(n, 1)})


def changed_blocks(elements: Tensor, blocks: Iterable[int]) -> dict[int, int]:
    """|C_b| for every b, from the changed elements' positions."""
    return {b: int(block_numbers(elements, b).numel()) for b in blocks}


def wire_bytes(changed: int, block: int, numel: int, itemsize: int) -> int:
    """wire(b) = |C_b| * (b * s + s_idx) (module docstring)."""
    return changed * (block * itemsize + (4 if index_dtype(numel // block) == torch.int32 else 8))


def choose_block(elements: Tensor, shape: torch.Size | tuple[int, ...], itemsize: int) -> tuple[int, dict[int, int]]:
    """(the b of least wire bytes, wire(b) for every candidate b) for the changed elements of a tensor of this
    shape; b = 0 if nothing changed. Ties go to the larger block (fewer index entries for the same bytes)."""
    n = 1
    for d in shape:
        n *= int(d)
    counts = changed_blocks(elements, candidate_blocks(shape))
    costs = {b: wire_bytes(k, b, n, itemsize) for b, k in counts.items()}
    if not elements.numel():
        return 0, costs
    return min(costs, key=lambda b: (costs[b], -b)), costs


def diff(name: str, old: Tensor, new: Tensor, block: int | None = None) -> Delta | None:
    """The delta taking ``old`` to ``new`` at block size ``block`` (None: the cheapest); None if equal."""
    elements = changed_elements(old, new)
    if not elements.numel():
        return None
    if block is None:
        block, _ = choose_block(elements, new.shape, new.element_size())
    if new.numel() % block:
        raise ValueError(f"{name}: block {block} does not divide its {new.numel()} elements")
    index = block_numbers(elements, block)
    values = new.contiguous().reshape(-1).view(_INT[new.element_size()]).view(-1, block).index_select(0, index)
    return Delta(name, index.to(index_dtype(new.numel() // block)), values.view(new.dtype))


def apply(held: Tensor, index: Tensor, values: Tensor) -> None:
    """In place: ``held.view(n / b, b)[index] = values`` (values cast to held's dtype; the copy itself moves
    bits, through integer views, so every dtype, float8 included, is copied exactly)."""
    kind = _INT[held.element_size()]
    bits = values.to(held.dtype).contiguous().view(kind)
    held.view(kind).view(-1, values.shape[1]).index_copy_(0, index.long(), bits)


def check(name: str, held: Tensor, index: Tensor, values: Tensor, castable: bool) -> None:
    """ValueError naming ``name`` unless (index, values) is a delta that ``apply`` can put into ``held``:
    index 1-D int32/int64, sorted and distinct, in [0, n / b); values [len(index), b] with b | n; values of
    held's dtype (or any float dtype when ``castable``: held is a high-precision tensor of the compute dtype)."""
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}{INDEX}: must be 1-D int32 or int64, got {index.dtype} {list(index.shape)}")
    if values.dim() != 2 or values.shape[0] != index.shape[0] or values.shape[1] < 1:
        raise ValueError(f"{name}{VALUES}: shape {list(values.shape)} is not [len(index) = {index.shape[0]}, block]")
    n, b = held.numel(), int(values.shape[1])
    if n % b:
        raise ValueError(f"{name}{VALUES}: block {b} does not divide the server's {n} elements "
                         f"(shape {list(held.shape)})")
    if not held.is_contiguous():
        raise ValueError(f"{name}: the server's tensor is not contiguous; a delta cannot be applied in place")
    ok_dtype = values.dtype == held.dtype or (castable and values.is_floating_point()
                                              and values.dtype != torch.float8_e4m3fn)
    if not ok_dtype:
        raise ValueError(f"{name}{VALUES}: dtype {values.dtype} differs from the server's {held.dtype}")
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= n // b:
            raise ValueError(f"{name}{INDEX}: block numbers [{lo}, {hi}] outside [0, {n // b}) "
                             f"(blocks of {b} elements)")
        if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
            raise ValueError(f"{name}{INDEX}: block numbers must be sorted and distinct")


def pair_parts(received: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """name -> (index, values) from the wire tensors of one bucket; ValueError naming an unpaired or
    non-delta tensor (a delta request carries only ``*.delta_index`` / ``*.delta_values`` pairs)."""
    index: dict[str, Tensor] = {}
    values: dict[str, Tensor] = {}
    for wire_name, t in received.items():
        if wire_name.endswith(INDEX):
            index[wire_name.removesuffix(INDEX)] = t
        elif wire_name.endswith(VALUES):
            values[wire_name.removesuffix(VALUES)] = t
        else:
            raise ValueError(f"{wire_name}: not a delta tensor (load_format {LOAD_FORMAT!r} takes "
                             f"'<name>{INDEX}' and '<name>{VALUES}' pairs)")
    for name in sorted(set(index) ^ set(values)):
        have = INDEX if name in index else VALUES
        raise ValueError(f"{name}: {have} came without its partner in the same request")
    return {name: (index[name], values[name]) for name in index}


class Baseline:
    """Learner rank 0's copy (CPU) of every tensor the servers hold: the last sync's payload.

    ``record`` keeps a full sync's tensors as they stream past; ``encode`` turns the next payload into
    deltas against it and advances it to the new tensors, so after a complete sync the baseline equals
    what a full sync of the same learner would have left on the servers. A sync that did not complete
    leaves a baseline the servers may not hold: the broadcaster then drops it (next sync full).
    """

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.blocks: dict[int, int] = {}  # chosen block size -> how many tensors used it (last encode)

    def record(self, stream: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Pass a full sync's tensors through, keeping a CPU copy of each."""
        self.tensors.clear()
        for name, t in stream:
            self.tensors[name] = t.detach().to("cpu", copy=True).contiguous()
            yield name, t

    def encode(self, stream: Iterable[tuple[str, Tensor]]) -> Iterator[Delta]:
        """The deltas of a payload against the baseline (which advances to the payload). ValueError if the
        payload's names, shapes or dtypes are not the baseline's (then only a full sync is sound)."""
        self.blocks = {}
        seen = 0
        for name, t in stream:
            old = self.tensors.get(name)
            if old is None or old.shape != t.shape or old.dtype != t.dtype:
                raise ValueError(f"{name}: not in the last full sync with this shape and dtype")
            seen += 1
            new = t.detach().to("cpu").contiguous()
            delta = diff(name, old, new)
            if delta is None:
                continue
            self.blocks[delta.block] = self.blocks.get(delta.block, 0) + 1
            apply(old, delta.index, delta.values)
            yield delta
        if seen != len(self.tensors):
            raise ValueError(f"the payload has {seen} tensors, the last full sync {len(self.tensors)}")
