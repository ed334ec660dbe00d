"""The Megatron learner trains on CPU, and its layout does not change the result."""

from __future__ import annotations

import pytest
import torch

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.moe.verify import world_size


def _train(model_dir: str, tp: int, ep: int, steps: int, poison_step: int = -1, micro: int | None = None) -> list[dict]:
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=7)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=1e-3, clip_grad=1.0), micro_batch_size=micro)
    learner.load_hf(model_dir)
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        tokens = torch.randint(0, arch.vocab_size, (4, 24), generator=gen)
        mask = torch.zeros(4, 23)
        mask[:, 8:] = 1  # "response" part only
        total = int(mask.sum())

        def loss_fn(logp, b, step=step, total=total):
            loss, metrics = token_mean_nll(logp, b, total)
            return (loss * float("nan") if step == poison_step else loss), metrics

        metrics = learner.train_step(Batch(tokens, mask), loss_fn)
        metrics["param_sum"] = sum(p.double().sum().item() for p in learner.module.parameters())
        out.append(metrics)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2)])
def test_five_steps_match_tp1(tp, ep, tiny_model_dir):
    ref = run_ranks(1, _train, tiny_model_dir, 1, 1, 5)[0]
    got = run_ranks(world_size(tp, ep), _train, tiny_model_dir, tp, ep, 5)
    ref_losses = [m["loss"] for m in ref]
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for rank_metrics in got:
        losses = [m["loss"] for m in rank_metrics]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-5, (losses, ref_losses)


def test_micro_batches_accumulate_to_the_whole_batch_step(random_model_dir):
    whole = run_ranks(1, _train, random_model_dir, 1, 1, 3)[0]
    micro = run_ranks(1, _train, random_model_dir, 1, 1, 3, -1, 1)[0]  # 4 micro-batches of one row
    for a, b in zip(whole, micro, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5
        assert abs(a["param_sum"] - b["param_sum"]) <= 1e-6 * max(1.0, abs(a["param_sum"]))


def test_non_finite_loss_skips_the_update(random_model_dir):
    metrics = run_ranks(1, _train, random_model_dir, 1, 1, 3, 1)[0]
    assert [m["skipped"] for m in metrics] == [0.0, 1.0, 0.0]
    assert metrics[1]["param_sum"] == metrics[0]["param_sum"]  # the skipped step changed nothing
    assert metrics[2]["param_sum"] != metrics[1]["param_sum"]


def test_batch_must_split_over_data_parallel_ranks(random_model_dir):
    with pytest.raises(RuntimeError, match="batch of 3 responses does not split over data-parallel size 2"):
        run_ranks(2, _bad_split, random_model_dir)


def _bad_split(model_dir):
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(ep=2)
    Learner(arch, ParallelConfig(ep=2), OptimConfig()).my_rows(3)


def _tbpo_steps(model_dir: str, tp: int, ep: int) -> list[dict]:
    from megatron_qarl.algo.policy_loss import PolicyLossConfig
    from megatron_qarl.learner.rank import policy_loss_fn
    from megatron_qarl.qat.config import QuantConfig

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=3)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=1e-4), quant=QuantConfig(scheme="w4a16"))
    learner.load_hf(model_dir)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, arch.vocab_size, (8, 20), generator=gen)
    mask = torch.zeros(8, 19)
    mask[:, 6:] = 1
    mask[0, 15:] = 0  # a shorter response
    old = learner.forward_logprobs(tokens) * mask
    sampler = old + 0.01 * torch.randn(old.shape, generator=gen) * mask  # a small train/serve mismatch
    batch = Batch(tokens, mask, {"adv_B": torch.tensor([1.0, -1.0] * 4), "logp_old_BT": old,
                                 "logp_sampler_BT": sampler})
    loss_fn = policy_loss_fn(PolicyLossConfig(mode="tbpo"), batch)
    return [learner.train_step(batch, loss_fn) for _ in range(2)]


@pytest.mark.multiproc
def test_tbpo_step_on_the_aligned_learner_matches_across_layouts(tiny_model_dir):
    ref = run_ranks(1, _tbpo_steps, tiny_model_dir, 1, 1)[0]
    assert ref[0]["skipped"] == 0 and ref[0]["grad_norm"] > 0
    assert "band_masked_frac_pos" in ref[0] and "mismatch_tok_abs_mean" in ref[0]
    got = run_ranks(2, _tbpo_steps, tiny_model_dir, 2, 2)[0]
    for a, b in zip(ref, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]


def _logprobs_at(model_dir: str, tp: int, temperature: float) -> torch.Tensor:
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, seed=3)
    learner = Learner(arch, ParallelConfig(tp=tp), OptimConfig(), temperature=temperature)
    learner.load_hf(model_dir)
    tokens = torch.randint(0, arch.vocab_size, (3, 20), generator=torch.Generator().manual_seed(5))
    return tokens, learner.forward_logprobs(tokens)


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_are_those_of_the_temperature_scaled_logits(tp, tiny_model_dir):
    """SGLang returns log_softmax(z / T): the learner's log-probs at T = 0.7 equal that of transformers' logits,
    at TP1 and with the vocabulary split over TP2."""
    from transformers import AutoModelForCausalLM

    tokens, logp_BT = run_ranks(tp, _logprobs_at, tiny_model_dir, tp, 0.7)[0]
    logits_BSV = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=tokens).logits
    want_BT = torch.log_softmax(logits_BSV[:, :-1] / 0.7, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert (logp_BT - want_BT).abs().max() < 1e-4
    at_t1_BT = torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert (logp_BT - at_t1_BT).abs().max() > 1e-2  # the temperature is not a no-op here


def test_temperature_must_be_positive(tiny_model_dir):
    with pytest.raises(ValueError, match="temperature: 0.0 must be > 0"):
        Learner(Qwen3MoeArch.from_model_dir(tiny_model_dir), ParallelConfig(), OptimConfig(), temperature=0.0)


def _routes_roundtrip(model_dir: str, tp: int, ep: int) -> dict:
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=3)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=1e-3), routing_replay=True,
                      micro_batch_size=2)
    learner.load_hf(model_dir)
    tokens = torch.randint(0, arch.vocab_size, (4, 19), generator=torch.Generator().manual_seed(5))
    free_BT, own_BSLK = learner.forward_routes(tokens)
    replayed_BT = learner.forward_logprobs(tokens, own_BSLK)
    other_BSLK = (own_BSLK + 1) % arch.num_experts  # every token to other experts
    moved_BT = learner.forward_logprobs(tokens, other_BSLK)
    mask = torch.ones(4, 18)
    metrics = learner.train_step(Batch(tokens, mask, {"routes_BSLK": other_BSLK}),
                                 lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
    return {"free": free_BT, "own": own_BSLK, "replayed": replayed_BT, "moved": moved_BT, "loss": metrics["loss"]}


@pytest.mark.multiproc
def test_routing_replay_reproduces_own_routes_and_moves_with_others(tiny_model_dir):
    """R3 through Megatron's RouterReplay: replaying the learner's own recorded routes gives its log-probs exactly,
    at TP1 and TP2xEP2 (so positions map to the routers' token order under sequence parallelism and EP); the
    routes recorded at TP2xEP2 are TP1's; other routes change the log-probs; a train step replays too."""
    ref = run_ranks(1, _routes_roundtrip, tiny_model_dir, 1, 1)[0]
    par = run_ranks(4, _routes_roundtrip, tiny_model_dir, 2, 2)[0]
    for out in (ref, par):
        assert out["own"].shape[:2] == (4, 19)
        assert (out["replayed"] - out["free"]).abs().max() <= 1e-5  # fp32 summation order of the k experts
        assert (out["moved"] - out["free"]).abs().max() > 1e-2
    assert torch.equal(par["own"], ref["own"])
    assert (par["free"] - ref["free"]).abs().max() < 1e-4
    assert abs(par["loss"] - ref["loss"]) < 1e-4


def _replayed_routes(model_dir: str, tp: int, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=3)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(), routing_replay=True)
    learner.load_hf(model_dir)
    tokens = torch.randint(0, arch.vocab_size, (4, 19), generator=torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(1)
    given = torch.stack([torch.randperm(arch.num_experts, generator=gen)[: arch.num_experts_per_tok]
                         for _ in range(4 * 19 * arch.num_hidden_layers)]).view(4, 19, arch.num_hidden_layers, -1)
    return given, learner.forward_routes(tokens, given)[1]


@pytest.mark.multiproc
def test_every_router_receives_the_replayed_routes_at_tp2_ep2(tiny_model_dir):
    """With replay, the experts each rank's routers hold for each position, read back and reassembled, are the
    given ones for 100% of positions at TP2xEP2."""
    given, used = run_ranks(4, _replayed_routes, tiny_model_dir, 2, 2)[0]
    assert torch.equal(used, given)


def _optimizer_state(model_dir: str, distributed: bool) -> dict[str, int]:
    """Adam moment elements this rank holds for dense and for expert parameters after one step (ep=2 on 2 ranks:
    dense DP 2, expert DP 1)."""
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(ep=2, seed=7)
    learner = Learner(arch, ParallelConfig(ep=2), OptimConfig(lr=1e-3), distributed_optimizer=distributed)
    learner.load_hf(model_dir)
    tokens = torch.randint(0, arch.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 15)
    learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
    out = {"dense": 0, "expert": 0}
    for opt in learner.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            kind = "expert" if group["is_expert_parallel"] else "dense"
            out[kind] += sum(opt.optimizer.state[p]["exp_avg"].numel() for p in group["params"])
    out["dense_params"] = sum(p.numel() for p in learner.module.parameters() if getattr(p, "allreduce", True))
    out["expert_params"] = sum(p.numel() for p in learner.module.parameters() if not getattr(p, "allreduce", True))
    return out


@pytest.mark.multiproc
def test_distributed_optimizer_shards_adam_over_data_parallel_ranks(random_model_dir):
    """learner.distributed_optimizer: each of the 2 data-parallel ranks keeps Adam for its share of the dense
    parameters only (together: each once); the experts, expert DP 1, stay whole. Without it every rank keeps all."""
    plain = run_ranks(2, _optimizer_state, random_model_dir, False)
    sharded = run_ranks(2, _optimizer_state, random_model_dir, True)
    for rank in plain:
        assert (rank["dense"], rank["expert"]) == (rank["dense_params"], rank["expert_params"])
    assert sum(r["dense"] for r in sharded) == sharded[0]["dense_params"]
    assert all(0 < r["dense"] < r["dense_params"] and r["expert"] == r["expert_params"] for r in sharded)


def _resume(model_dir: str, tmp: str, distributed: bool) -> tuple[list, list]:
    """Two steps, a dist-checkpointing save, two more steps; then a fresh learner loads the save and runs the
    same two steps: (the uninterrupted run's metrics, the resumed run's)."""
    from megatron_qarl.learner import checkpoint

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(ep=2, seed=7)

    def learner():
        return Learner(arch, ParallelConfig(ep=2), OptimConfig(lr=1e-2, clip_grad=1.0),
                       distributed_optimizer=distributed)

    def steps(lrn, gen, n):
        out = []
        for _ in range(n):
            tokens = torch.randint(0, arch.vocab_size, (4, 16), generator=gen)
            mask = torch.ones(4, 15)
            total = int(mask.sum())
            m = lrn.train_step(Batch(tokens, mask), lambda lp, b, n=total: token_mean_nll(lp, b, n))
            out.append((m["loss"], m["grad_norm"], sum(p.double().sum().item() for p in lrn.module.parameters())))
        return out

    first = learner()
    first.load_hf(model_dir)
    gen = torch.Generator().manual_seed(0)
    steps(first, gen, 2)
    checkpoint.save_learner(tmp, first.module, first.optimizer)
    state = gen.get_state()
    uninterrupted = steps(first, gen, 2)
    resumed = learner()  # randomly initialised: everything must come from the checkpoint
    checkpoint.load_learner(tmp, resumed.module, resumed.optimizer)
    gen.set_state(state)
    return uninterrupted, steps(resumed, gen, 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("distributed", [True, False])
def test_resume_restores_the_optimizer_exactly(distributed, random_model_dir, tmp_path):
    """dist-checkpointing save / load of the (distributed) optimizer: the resumed learner's next two steps equal
    the uninterrupted ones exactly, Adam's moments and step count included (the second step depends on them)."""
    for uninterrupted, resumed in run_ranks(2, _resume, random_model_dir, str(tmp_path), distributed):
        assert resumed == uninterrupted


def _recompute_steps(model_dir: str, recompute: str) -> tuple[list[dict], dict[str, int]]:
    from megatron_qarl.qat.config import QuantConfig

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(seed=7)
    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-3), quant=QuantConfig(scheme="w4a16"),
                      recompute=recompute, micro_batch_size=2)
    learner.load_hf(model_dir)
    calls = {"layer": 0, "core_attention": 0}
    layer = learner.module.decoder.layers[0]
    layer.register_forward_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
    layer.self_attention.core_attention.register_forward_hook(
        lambda *_: calls.__setitem__("core_attention", calls["core_attention"] + 1))
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, arch.vocab_size, (4, 16), generator=gen)
        mask = torch.ones(4, 15)
        total = int(mask.sum())
        out.append(learner.train_step(Batch(tokens, mask), lambda lp, b, n=total: token_mean_nll(lp, b, n)))
    return out, calls


def test_recompute_reruns_the_forward_and_changes_nothing(random_model_dir):
    """learner.recompute through Megatron's recompute (on the W4A16 aligned learner, 2 steps of 2 micro-batches):
    selective reruns the core attention, full whole layers, in the backward; losses and gradients are those of
    no recompute."""
    ref, calls = run_ranks(1, _recompute_steps, random_model_dir, "none")[0]
    assert calls == {"layer": 4, "core_attention": 4}
    for recompute, rerun in (("selective", {"layer": 4, "core_attention": 8}),
                             ("full", {"layer": 8, "core_attention": 8})):
        got, calls = run_ranks(1, _recompute_steps, random_model_dir, recompute)[0]
        assert calls == rerun, recompute
        for a, b in zip(ref, got, strict=True):
            assert a["loss"] == b["loss"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), recompute


def test_optimizer_cpu_offload_and_full_recompute_with_replay_are_refused(tiny_model_dir):
    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"optimizer_cpu_offload: .*HybridDeviceOptimizer .* needs CUDA"):
            Learner(arch, ParallelConfig(), OptimConfig(), optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match=r"recompute: 'full' reruns the routers in the backward"):
        Learner(arch, ParallelConfig(), OptimConfig(), routing_replay=True, recompute="full")


def test_a_learner_rank_refuses_an_nccl_environment_that_would_not_honour_its_timeouts(monkeypatch):
    """Issue 53 item 5: what matters is the environment each rank's actor got (legacy names included), checked
    there before the rank joins a group; on gloo the variables change nothing."""
    from megatron_qarl.errors import UserError
    from megatron_qarl.learner import worker
    from megatron_qarl.moe import parallelize

    worker.require_bounded_nccl(3, {"NCCL_ASYNC_ERROR_HANDLING": "0"})  # gloo here: fine
    monkeypatch.setattr(parallelize, "dist_backend", lambda: "nccl")
    with pytest.raises(UserError, match=r"learner rank 3: NCCL_ASYNC_ERROR_HANDLING=0 \(torch's legacy name"):
        worker.require_bounded_nccl(3, {"NCCL_ASYNC_ERROR_HANDLING": "0"})
    worker.require_bounded_nccl(3, {"NCCL_ASYNC_ERROR_HANDLING": "1"})
