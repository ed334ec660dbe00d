"""No silent cliff: a low-bit layer whose kernel is slower than the dense one on this machine is reported when
the model loads, with the measured figures.

Why: the kernel a scheme gets depends on the CPU (``linear.py``, ``native.py``). Where the best one is slow
(INT8 on oneDNN's u8s8 GEMM without VNNI took ~280x the BF16 time per step on an AVX2 EPYC), a user who picked
the scheme for speed would otherwise find out from a benchmark, or never.

``check`` runs once per process for each (format, kernels, N, K, compute dtype, row counts): the layer's own
forward (activation quantization included) against the dense GEMM the unquantized scheme runs for a random
weight of the same [N, K] in the same compute dtype, on the row counts a decode step gives the layer: 1 and 16
(batch-1 decode and a batch of 16) for attention, 1 and 2 for a routed expert (a batch of 16 spreads 16 x top-k
rows over the experts: 1-2 each for Qwen3-30B-A3B's 128 experts, top-8). One torch thread, so that OpenMP
wake-ups and other processes' load weigh less; best of up to 10 calls; a layer of at least ``LARGE`` weights
is timed with its weights out of the caches (a 64 MiB buffer read before each call), as decode streams them.
A layer of at least ``LARGE`` weights that is more than 10% slower at either row count (a margin for the noise
of shared machines: the check is for cliffs), or a smaller one that takes more than twice the dense time
(there per-call costs, not the kernel, decide), gets a WARNING naming the scheme,
the kernels, the figures and the layer shape; every result stays in ``RESULTS`` (benchmarks/decode.py prints
them). The check adds a few milliseconds per small weight shape at load, ~0.1 s per large one (seconds
where a kernel is that slow). It sets torch's thread count (process-wide) to 1 while it runs: it runs when a
model loads, before the engine serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

log = logging.getLogger(__name__)
ROWS = (1, 16)  # attention and other linears every token goes through
EXPERT_ROWS = (1, 2)  # a routed expert
CALLS = 10
CLIFF = 20.0  # a one-row time this many times the dense one: the 16-row measurement is skipped
LARGE = 1 << 20  # weights per layer from which the kernel, not the per-call cost, decides
RESULTS: dict[tuple, dict[int, tuple[float, float]]] = {}


def _best(fn: Callable[[], object], evict: Tensor | None, calls: int = CALLS, budget_s: float = 0.05) -> float:
    """Seconds of the fastest of up to ``calls`` calls after a warm-up call (fewer if they are slow); with
    ``evict``, that buffer is read before each timed call (the weights leave the caches)."""
    fn()
    best = float("inf")
    for i in range(calls):
        if evict is not None:
            evict.sum()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if best > budget_s and i >= 1:
            break
    return best


def check(fmt: str, layer: Callable[[Tensor], Tensor], n: int, k: int, dtype: torch.dtype,
          dense_gemm: Callable[[Tensor], Callable[[Tensor], Tensor]],
          row_counts: tuple[int, ...] = ROWS) -> dict[int, tuple[float, float]]:
    """Measure ``layer`` ([T, k] -> [T, n], its ``kernel`` dict naming what runs) against ``dense_gemm(w)`` for
    a dense [n, k] weight at ``row_counts``; warn if it is slower. Returns {rows: (low-bit s, dense s)}."""
    kernel = getattr(layer, "kernel", {})
    key = (fmt, kernel.get("1 row"), kernel.get("rows"), n, k, dtype, row_counts)
    if key in RESULTS:
        return RESULTS[key]
    g = torch.Generator().manual_seed(0)
    dense = dense_gemm((torch.randn(n, k, generator=g) * 0.02).to(dtype))
    evict = torch.ones(16 << 20) if n * k >= LARGE else None  # 64 MiB
    res: dict[int, tuple[float, float]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for rows in row_counts:
                x = torch.randn(rows, k, generator=g).to(dtype)
                low, ref = _best(lambda x=x: layer(x), evict), _best(lambda x=x: dense(x), evict)
                res[rows] = (low, ref)
                if low > CLIFF * ref:
                    break
    finally:
        torch.set_num_threads(threads)
    RESULTS[key] = res
    margin = 1.1 if n * k >= LARGE else 2.0
    slow = {rows: t for rows, t in res.items() if t[0] > margin * t[1]}
    if slow:
        figures = "; ".join(f"{rows} row(s): {low * 1e6:.0f} us vs {ref * 1e6:.0f} us dense ({low / ref:.1f}x)"
                            for rows, (low, ref) in slow.items())
        log.warning("%s decodes slower than the unquantized model on this CPU: a [%d, %d] layer on %s (1 row) / %s "
                    "(several rows; %s) measured %s, in %s. Choose another scheme for speed here, or see "
                    "docs/rollout.md (kernels per scheme).", fmt, n, k, kernel.get("1 row"), kernel.get("rows"),
                    kernel.get("why"), figures, str(dtype).removeprefix("torch."))
    return res
