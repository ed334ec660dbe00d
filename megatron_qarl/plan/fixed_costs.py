"""What a GPU adds to a learner rank's memory that a shape-only simulation cannot see, item by item, each with its
public source; the planner counts them instead of a lump reserve (``qarl plan`` states the margin left).

    item                 bytes                                        source
    cuda_context         768 MiB                                      measured by PyTorch users: 723 MiB for a one-
                                                                      element tensor, "~700+MB" (discuss.pytorch.org
                                                                      /t/73021, /t/81330); CUDA's lazy loading
                                                                      (default since 12.2) lowers it, kernels a
                                                                      training step loads raise it
    cublas_workspaces    32 MiB x streams                             cuBLASLt workspace PyTorch gives each (handle,
                                                                      stream) on compute capability >= 9.0
                                                                      (pytorch/pytorch#120925, aten/src/ATen/cuda/
                                                                      CUDABlas.cpp; cuBLAS docs, cublasSetWorkspace:
                                                                      32 MiB recommended on Hopper)
    te_workspaces        32 MiB x (1 + 4 streams)                     Transformer Engine's cuBLASLt workspace on
                                                                      Hopper and one per cuBLAS stream of its grouped
                                                                      GEMMs (transformer_engine/pytorch/module/base.py:
                                                                      get_cublas_workspace_size_bytes, 4 streams);
                                                                      the TE spec only
    nccl_buffers         per communicator: channels x 2 (a ring       a connection holds one buffer per protocol
                         channel's two connections) x CONNECTION;     (NCCL src/include/device.h, ncclConnInfo.buffs
                         all-to-all: + peers x CONNECTION, where      [NCCL_NUM_PROTOCOLS]; sizes in src/init.cc
                         CONNECTION = Simple 4 MiB (NCCL_BUFFSIZE)    computeBuffSizes): Simple = NCCL_BUFFSIZE,
                         + LL 512 KiB + LL128 4.69 MiB = 9.19 MiB     documented default 4 MiB (docs.nvidia.com/
                                                                      deeplearning/nccl/user-guide/docs/env.html);
                                                                      LL = 8 lines/thread x 512 threads x 8 steps x
                                                                      16 B; LL128 = 120 elements/thread x 640
                                                                      threads x 8 steps x 8 B (LL128 is on for
                                                                      Hopper's NVLink); ``nccl_channels`` (16 here,
                                                                      up to NCCL's maxCTAs default of 32) is a stated
                                                                      assumption, NCCL picks it per topology; NCCL
                                                                      >= 2.22 connects lazily (NCCL_RUNTIME_CONNECT),
                                                                      so a protocol a communicator never runs costs
                                                                      nothing there: this is the upper bound
    allocator_rounding   what the caching allocator reserves beyond   PyTorch CUDA semantics, memory management
                         the live bytes (``tracker.allocator_         (pytorch.org/docs/stable/notes/cuda.html):
                         rounding``: allocations >= 10 MiB round up   requests round to 512 B, large segments to
                         to 2 MiB), measured by the simulation per    2 MiB; not counted: fragmentation between
                         phase: ``ROUNDING_PER_LAYER`` per layer +    segments (expandable_segments:True avoids most)
                         ``ROUNDING_ONCE`` at the planner

The learner's communicators with more than one rank: world, TP, DP, EP (all-to-all), expert DP, the model-parallel
group of the gradient norm, and on rank 0 the weight-update group with the rollout servers.
"""

from __future__ import annotations

import dataclasses

from megatron_qarl.plan.memory import LearnerLayout

MIB = 2**20
CUDA_CONTEXT = 768 * MIB
CUBLAS_WORKSPACE = 32 * MIB
TE_WORKSPACE = 32 * MIB
TE_CUBLAS_STREAMS = 4
NCCL_BUFFSIZE = 4 * MIB  # Simple protocol
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x a 16-B line
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 B
NCCL_CONNECTION = NCCL_BUFFSIZE + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
# the allocator's rounding at a phase's peak, measured by the simulation (``tracker.allocator_rounding``): at most 2 MiB
# per layer (Qwen3-30B-A3B bf16, tp4/ep8: 4.7 MiB at 2 layers, 8.7 at 4) and 7.7 MiB once (the sync's peak); Qwen3-235B
# 3.8-7.4 MiB at 2 and 4 layers alike
ROUNDING_PER_LAYER = 2 * MIB
ROUNDING_ONCE = 8 * MIB


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedCostOptions:
    nccl_channels: int = 16
    compute_streams: int = 2  # the default stream and Megatron's side streams that run GEMMs


def communicators(lay: LearnerLayout, rank0: bool = True) -> dict[str, int]:
    """Size of each NCCL communicator a learner rank of ``lay`` uses (those of one rank are left out)."""
    sizes = {"world": lay.gpus, "tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "expert_dp": lay.edp,
             "model_parallel": lay.tp * lay.ep}
    if rank0:
        sizes["weight_update"] = 2  # rank 0 and at least one server rank
    return {k: v for k, v in sizes.items() if v > 1}


def fixed_costs(lay: LearnerLayout, *, layers: int, te: bool, opts: FixedCostOptions = FixedCostOptions(),
                rank0: bool = True) -> dict[str, int]:
    """Bytes per learner GPU by item (module docstring), with ``total``."""
    comms = communicators(lay, rank0)
    nccl = sum(opts.nccl_channels * NCCL_CONNECTION * 2 for _ in comms)
    nccl += (lay.ep - 1) * NCCL_CONNECTION if lay.ep > 1 else 0
    out = {"cuda_context": CUDA_CONTEXT, "cublas_workspaces": CUBLAS_WORKSPACE * opts.compute_streams,
           "te_workspaces": TE_WORKSPACE * (1 + TE_CUBLAS_STREAMS) if te else 0, "nccl_buffers": nccl,
           "allocator_rounding": ROUNDING_PER_LAYER * layers + ROUNDING_ONCE}
    out["total"] = sum(out.values())
    return out
