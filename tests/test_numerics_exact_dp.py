"""numerics: exact under data parallelism with float32 activations (issue 38 item 3): the learner's forward
multiplies a float32 parameter as it is, through the K-major copy ``numerics.native.transposed`` keeps on it, and
Megatron's distributed optimizer refreshes the parameters a rank does not own by an all-gather that leaves their
``_version`` unchanged. No such copy may outlive an optimizer step (``learner.rank.weights_changed``)."""

from __future__ import annotations

import pytest
import torch

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.moe.verify import world_size
from megatron_qarl.numerics import native, ops

STEPS = 3


def _tokens(rows: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 32, (rows, length), generator=torch.Generator().manual_seed(seed))


def _train_then_check(model_dir: str, ep: int, tokens: torch.Tensor) -> dict:
    """``STEPS`` optimizer steps (float32 weights and activations, the distributed optimizer); returns each step's
    loss and grad norm, and the names of the 2-D parameters whose exact linear, on this rank, no longer equals the
    same linear of a fresh copy of the parameter (a cached K-major copy of older weights)."""
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=1, ep=ep, seed=7)
    learner = Learner(arch, ParallelConfig(tp=1, ep=ep), OptimConfig(lr=1e-3), numerics="exact",
                      act_dtype=torch.float32, distributed_optimizer=True)
    learner.load_hf(model_dir)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    steps = [learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
             for _ in range(STEPS)]
    x = torch.randn(5, 4096, generator=torch.Generator().manual_seed(0))
    stale = []
    with torch.no_grad():
        for name, p in learner.module.named_parameters():
            if p.dim() != 2:
                continue
            xk = x[:, : p.shape[1]].contiguous()
            if not torch.equal(ops.linear(xk, p), native.linear(xk, p.detach().clone(), ops.chunk_of(p.shape[1]))):
                stale.append(name)
    return {"steps": [(s["loss"], s["grad_norm"]) for s in steps], "stale": stale, "dp": learner.dp_size}


@pytest.mark.multiproc
def test_no_cached_weight_outlives_an_optimizer_step_at_dp2(tiny_model_dir):
    """EP 2 on 2 ranks (data parallel 2 for the dense parameters, sharded by the distributed optimizer): after
    every step each rank's exact linears compute with the current parameters, and the losses and grad norms follow
    the single-rank run's (to float32 rounding: the gradient reductions differ) at every step, not only the first."""
    tokens = _tokens(4, 20)
    ref = run_ranks(1, _train_then_check, tiny_model_dir, 1, tokens)[0]
    assert ref["stale"] == []
    for rank, got in enumerate(run_ranks(world_size(1, 2), _train_then_check, tiny_model_dir, 2, tokens)):
        assert got["dp"] == 2
        assert got["stale"] == [], f"rank {rank}: cached weights of an older step: {got['stale']}"
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"rank {rank} step {step + 1}: loss"
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"rank {rank} step {step + 1}: grad norm"
