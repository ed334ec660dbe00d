"""Packed sequences (issue 55, ``learner/packing.py``): the learner's rows end to end, the core attention within each
row (a block-diagonal causal mask, Megatron's THD format), give the log-probs of the right-padded rows: at TP 1 and at
TP 2 with sequence parallelism, in the log-prob forward and through a train step (selective recompute of the core
attention included)."""

from __future__ import annotations

import pytest
import torch
from combination_runs import FP32_TOKEN, PER_TOKEN

from megatron_qarl.learner.packing import loss_lengths, pack, unpack
from megatron_qarl.moe.parallelize import init_parallel, run_ranks


def test_pack_lays_the_rows_end_to_end_and_unpack_puts_the_scores_back():
    tokens = torch.arange(18).reshape(3, 6)
    p = pack(tokens, [4, 0, 6], multiple=4, pad_id=99)
    assert p.tokens.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 99, 99]]  # 10 tokens + a pad segment of 2
    assert p.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert p.cu_seqlens.tolist() == [0, 4, 10, 12] and p.cu_seqlens.dtype == torch.int32 and p.max_len == 6
    assert p.labels[0, :3].tolist() == [1, 2, 3] and p.labels[0, 4:9].tolist() == [13, 14, 15, 16, 17]
    assert p.scored.tolist() == [True, True, True, False, True, True, True, True, True, False]
    values = torch.arange(12.0)[None].requires_grad_()
    out = unpack(values, p, (3, 6))
    assert out.tolist() == [[0, 1, 2, 0, 0, 0], [0] * 6, [4, 5, 6, 7, 8, 0]]
    out.sum().backward()
    assert values.grad.tolist() == [[1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"lengths: \[7, 0, 6\] do not fit 3 rows of 6 tokens"):
        pack(tokens, [7, 0, 6])


def test_loss_lengths_end_at_each_rows_last_loss_target():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    assert loss_lengths(mask) == [4, 0, 6]  # logp[t] scores token t + 1: row 0 needs tokens 0..3, row 2 all 6


def _packed_vs_padded(model_dir: str, tp: int) -> dict:
    """Log-probs of held-out problems from one learner, right-padded and packed; then a train step of a packing
    learner (selective recompute) and of one that does not, and their log-probs after it."""
    from test_attention import _learner, _problem_tokens

    from megatron_qarl.learner import packing
    from megatron_qarl.learner.rank import Batch, token_mean_nll

    init_parallel(tp=tp)
    tokens, mask = _problem_tokens(12)
    loss_mask = mask.float()
    loss_mask[:, :5] = 0  # the prompt: log-probs no loss reads
    lengths = loss_lengths(loss_mask)
    calls = []
    real_pack = packing.pack
    packing.pack = lambda *a, **k: calls.append(a[1]) or real_pack(*a, **k)
    try:
        learner = _learner(model_dir, torch.float32, "w4a16", "sdpa", tp=tp)
        padded, packed = learner.forward_logprobs(tokens), learner.forward_logprobs(tokens, lengths=lengths)
        after = {}
        for packs in (True, False):
            learner = _learner(model_dir, torch.float32, "w4a16", "sdpa", tp=tp, recompute="selective")
            learner.packs = packs
            learner.train_step(Batch(tokens, loss_mask), lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.sum()))
            after[packs] = learner.forward_logprobs(tokens)
    finally:
        packing.pack = real_pack
    scored = torch.arange(tokens.shape[1] - 1)[None] < torch.tensor(lengths)[:, None] - 1
    return {"forward": (packed - padded)[scored].abs(), "zeros": packed[~scored].abs().max().item(),
            "step": (after[True] - after[False])[mask].abs(), "packed_rows": calls}


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_log_probs_equal_the_padded_ones(tiny_model_dir, tp):
    results = run_ranks(tp, _packed_vs_padded, tiny_model_dir, tp)
    for r in results:
        print(f"\ntp {tp}: packed - padded, max {r['forward'].max():.3g}; after a train step max {r['step'].max():.3g}")
        assert r["forward"].max() <= FP32_TOKEN and r["forward"].mean() <= PER_TOKEN, r["forward"].max()
        assert r["zeros"] == 0.0  # no log-prob computed past a row's last loss target
        assert r["step"].max() <= FP32_TOKEN and r["step"].mean() <= PER_TOKEN, r["step"].max()
        assert r["packed_rows"] and all(len(rows) == 12 for rows in r["packed_rows"])  # the packed path ran


def _device_reads(model_dir: str) -> dict:
    """Reads of simulated-device values on the host (``_local_scalar_dense``, ``item``, ``is_nonzero``,
    ``nonzero`` of a device tensor) in a train step, packed and right-padded, on the simulated CUDA device."""
    import torch.distributed as dist
    from test_attention import _learner, _problem_tokens

    from megatron_qarl.gpu import simulated_device as sd
    from megatron_qarl.learner.rank import Batch, token_mean_nll
    from megatron_qarl.moe.parallelize import single_rank_env

    single_rank_env()
    dist.init_process_group("gloo")
    reads = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
             "aten.nonzero.default"}
    counted, run = [], sd._run

    def counting(func, args, kwargs):
        if str(func) in reads and any(isinstance(a, sd.SimTensor) for a in args):
            counted.append(str(func))
        return run(func, args, kwargs)

    tokens, mask = _problem_tokens(6)
    out = {}
    sd._run = counting
    try:
        with sd.simulated_cuda():
            init_parallel()
            for packs in (True, False):
                learner = _learner(model_dir, torch.float32, "bf16", "sdpa")
                learner.packs = packs
                batch = Batch(tokens, mask.float())
                learner.train_step(batch, lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.sum()))
                counted.clear()
                learner.train_step(batch, lambda lp, b: token_mean_nll(lp, b, b.loss_mask_BT.sum()))
                out[packs] = list(counted)
    finally:
        sd._run = run
    return out


@pytest.mark.simulated_device
def test_packing_reads_no_device_value_on_a_simulated_gpu(tiny_model_dir):
    """The lengths and cu_seqlens stay on the host (``Packed.to``): Megatron's THD rope reads them in every layer, which
    on a GPU would be a device sync each time. On the simulated device a packed train step reads the device exactly
    as often as a right-padded one (the loss and the gradient norm)."""
    reads = run_ranks(1, _device_reads, tiny_model_dir)[0]
    assert reads[True] == reads[False] and len(reads[True]) <= 2, reads
