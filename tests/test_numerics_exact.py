"""numerics: exact: the learner's log-probs equal the embedded engine's bit for bit (W4A16, W8A8-INT8, W8A8-FP8,
BF16), at every learner TP x EP layout, and the engine's own results do not depend on the batch, on prefill vs
decode, or on a retract and re-prefill (docs/numerics.md)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.moe.verify import world_size
from megatron_qarl.numerics import native, ops
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.serve.model import Qwen3MoeEngineModel

SCHEMES = ["w4a16", "w8a8_int8", "w8a8_fp8", "bf16"]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """What the servers load per scheme: the one quantizer's export (bf16: the checkpoint itself)."""
    from megatron_qarl.qat.export import quantize_checkpoint

    out = {"bf16": tiny_model_dir}
    for scheme in SCHEMES[:3]:
        d = tmp_path_factory.mktemp(scheme)
        quantize_checkpoint(tiny_model_dir, scheme, d)
        out[scheme] = str(d)
    return out


def _tokens(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 32, (rows, length), generator=torch.Generator().manual_seed(seed))


def _learner_logprobs(model_dir: str, scheme: str, tp: int, ep: int, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_qarl.learner.rank import Learner

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=7)
    quant = QuantConfig(scheme=scheme) if scheme != "bf16" else None
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=1e-3), quant=quant, numerics="exact",
                      act_dtype=torch.bfloat16)
    learner.load_hf(model_dir)
    return learner.forward_logprobs(tokens)


def _engine(model_dir: str, slots: int = 16) -> Qwen3MoeEngineModel:
    return Qwen3MoeEngineModel.from_model_dir(model_dir, torch.bfloat16, slots, 64, numerics="exact")


def _engine_logprobs(model: Qwen3MoeEngineModel, tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    logits = model.forward(tokens, torch.arange(b), torch.arange(s)[None].expand(b, s), all_logits=True)
    return ops.log_softmax(logits[:, :-1]).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.multiproc
@pytest.mark.parametrize("scheme", SCHEMES)
def test_learner_logprobs_equal_the_engine_bit_for_bit(scheme, checkpoints, tiny_model_dir):
    tokens = _tokens(6, 24)
    want = _engine_logprobs(_engine(checkpoints[scheme]), tokens)
    got = run_ranks(1, _learner_logprobs, tiny_model_dir, scheme, 1, 1, tokens)[0]
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} log-probs differ"


@pytest.mark.multiproc
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8_int8"])
def test_learner_layouts_give_the_same_bits(scheme, tiny_model_dir):
    """TP x EP = 1x1, 2x1, 1x2, 2x2: the same log-prob bits."""
    tokens = _tokens(4, 20, seed=1)
    ref = run_ranks(1, _learner_logprobs, tiny_model_dir, scheme, 1, 1, tokens)[0]
    for tp, ep in [(2, 1), (1, 2), (2, 2)]:
        for got in run_ranks(world_size(tp, ep), _learner_logprobs, tiny_model_dir, scheme, tp, ep, tokens):
            assert torch.equal(got, ref), f"TP{tp} x EP{ep}: {int((got != ref).sum())} log-probs differ"


def _one_step(model_dir: str, tp: int, ep: int, tokens: torch.Tensor) -> dict:
    from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=7)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=1e-3), quant=QuantConfig(scheme="w4a16"),
                      numerics="exact", act_dtype=torch.bfloat16)
    learner.load_hf(model_dir)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    return learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))


@pytest.mark.multiproc
def test_a_training_step_has_the_same_loss_and_gradient_at_every_layout(tiny_model_dir):
    """The loss (from the exact log-probs) is the same bits; the gradient norm (ordinary autograd, the TP and EP
    backward collectives) agrees to float32 rounding: the gradient is the same gradient at every layout."""
    tokens = _tokens(4, 20, seed=2)
    ref = run_ranks(1, _one_step, tiny_model_dir, 1, 1, tokens)[0]
    assert ref["grad_norm"] > 0 and ref["skipped"] == 0
    for tp, ep in [(2, 1), (1, 2), (2, 2)]:
        got = run_ranks(world_size(tp, ep), _one_step, tiny_model_dir, tp, ep, tokens)[0]
        assert got["loss"] == ref["loss"], f"TP{tp} x EP{ep}"
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], f"TP{tp} x EP{ep}"


def test_prefill_equals_decode_and_any_batch(checkpoints):
    """A sequence's logits alone, inside a batch of 16, token by token (decode), and re-prefilled: the same bits."""
    model = _engine(checkpoints["w4a16"])
    tokens = _tokens(16, 12, seed=3)
    pos = torch.arange(12)[None].expand(16, 12)
    batch = model.forward(tokens, torch.arange(16), pos, all_logits=True)
    alone = model.forward(tokens[5:6], torch.tensor([0]), pos[:1], all_logits=True)
    assert torch.equal(alone[0], batch[5])
    for t in range(12):  # decode in slot 9, next to 15 other rows decoding their own tokens
        others = [r for r in range(16) if r != 9]
        rows = torch.tensor([5, *others[:15]])
        step = model.forward(tokens[rows, t : t + 1], torch.tensor([9, *others[:15]]), torch.full((16, 1), t))
        assert torch.equal(step[0], batch[5, t]), f"position {t}"


def test_kernels_match_their_torch_references_and_are_row_independent():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=g), torch.randn(40, 96, generator=g)
    y = ops.linear(x, w)
    assert torch.allclose(y, x @ w.T, atol=1e-4)
    assert all(torch.equal(ops.linear(x[i : i + 1], w)[0], y[i]) for i in range(64))
    assert torch.equal(ops.linear(x[3:10], w), y[3:10])  # an odd row count: rows in pairs and one alone
    parts = ops.linear_partials(x, w)
    assert parts.shape == (64, 40, 3) and torch.equal(ops.sum_chunks(parts), y)
    assert torch.allclose(ops.rms_norm(x, w[0], 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[0],
                          atol=1e-5)
    assert torch.allclose(ops.silu_mul(x, y[:, :1].expand(64, 96)), torch.nn.functional.silu(x) * y[:, :1], atol=1e-5)
    assert torch.allclose(ops.log_softmax(y), torch.log_softmax(y, -1), atol=1e-5)
    q, k, v = (torch.randn(2, 7, 4, 32, generator=g), torch.randn(2, 7, 2, 32, generator=g),
               torch.randn(2, 7, 2, 32, generator=g))
    assert torch.allclose(ops.attention_causal(q, k, v), ops._causal_ref(q, k, v, 32**-0.5), atol=1e-5)
    ids, wts, order = ops.route(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), 2, True)  # a tie: the lower id wins
    assert ids.tolist() == [[1, 2]] and order.tolist() == [[1, 2]] and torch.allclose(wts, torch.tensor([[0.5, 0.5]]))


def _attention_composed(x, ln, w_qkv, qkv_q, qn, kn, cos, sin, kc, vc, hq, w_o, o_q, act, slots, pos):
    """The engine's attention block as numerics/layers.py composes it (the learner's path, minus TP)."""
    from megatron_qarl.numerics import layers

    _, hkv, seq, d = kc.shape
    h = layers.norm(x, ln, 1e-6, act)
    qkv = layers.dense(ops.quant_act(h, *qkv_q), w_qkv, act)
    q, k = layers.qk_norm_rope(qkv[:, : hq * d].reshape(-1, hq, d), qkv[:, hq * d : (hq + hkv) * d].reshape(-1, hkv, d),
                               qn, kn, cos[pos], sin[pos], 1e-6, act)
    kc[slots, :, pos] = k
    vc[slots, :, pos] = qkv[:, (hq + hkv) * d :].reshape(-1, hkv, d)
    o = native.attention(q.contiguous(), kc, vc, slots * (hkv * seq * d), pos + 1, hkv, d, seq * d, d**-0.5)
    o = ops.round_to(o, act).reshape(-1, hq * d)
    return ops.round_to(x + layers.dense(ops.quant_act(o, *o_q), w_o, act), act)


def _moe_composed(x, ln, w_router, top_k, w_gu, w_down, gu_q, down_q, act):
    from megatron_qarl.numerics import layers

    n = layers.norm(x, ln, 1e-6, act)
    ids, w, order = layers.moe_route(n, w_router, top_k, True)
    y = torch.zeros(*ids.shape, x.shape[1])
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        gate, up = layers.dense(ops.quant_act(n[rows], *gu_q), w_gu[e], act).chunk(2, dim=-1)
        h = ops.round_to(ops.silu_mul(gate, up), act)
        y[rows, slot] = layers.dense(ops.quant_act(h, *down_q), w_down[e], act)
    return ops.round_to(x + ops.round_to(ops.combine(w, y), act), act), order


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quant", [("bf16", None), ("w8a8_int8", None), ("w8a8_fp8", 8)])
def test_the_engines_fused_blocks_equal_the_composition_of_the_kernels(act, quant):
    """exact.c's attention and MoE blocks (the engine's decode and prefill) against numerics/layers.py's composition
    (the learner's), bit for bit: rows of different slots, two rows of one sequence in one call (the second reads the
    first's key), K not a multiple of the chunk (hidden 40), W8A8 activations, a router tie."""
    g = torch.Generator().manual_seed(2)
    hid, hq, hkv, d, ffn, experts, seq = 40, 4, 2, 8, 24, 6, 16

    def rnd(*shape, scale=0.3):
        return ops.round_to(torch.randn(*shape, generator=g) * scale, act)

    x = rnd(5, hid, scale=1.0)
    ln, qn, kn = rnd(hid) + 1, rnd(d) + 1, rnd(d) + 1
    ln[1::8] = ops.round_to(torch.tensor(1e-6), act)  # inputs tiny beside their group's max: fp8's subnormal codes
    w_qkv, w_o = rnd((hq + 2 * hkv) * d, hid), rnd(hid, hq * d)
    cos, sin = ops.rope_tables(seq, d, 10000.0)
    slots, pos = torch.tensor([2, 0, 0, 3, 1]), torch.tensor([5, 3, 4, 0, 9])
    kc = rnd(4, hkv, seq, d)
    vc = rnd(4, hkv, seq, d)
    kc2, vc2 = kc.clone(), vc.clone()
    want = _attention_composed(x, ln, w_qkv, quant, qn, kn, cos, sin, kc, vc, hq, w_o, quant, act, slots, pos)
    got = x.clone()
    attn = native.AttnBlock(ln, 1e-6, w_qkv, quant, qn, kn, cos, sin, kc2, vc2, hq, w_o, quant, ops.CHUNK, act)
    attn(got, native.CacheRows(pos, slots, 4, seq))
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)

    w_gu, w_down = [rnd(2 * ffn, hid) for _ in range(experts)], [rnd(hid, ffn) for _ in range(experts)]
    for w_router in (rnd(experts, hid), torch.ones(experts, hid)):  # the second: every expert ties
        want, order = _moe_composed(x, ln, w_router, 3, w_gu, w_down, quant, quant, act)
        got = x.clone()
        block = native.MoeBlock(ln, 1e-6, w_router, 3, True, w_gu, w_down, quant, quant, ops.CHUNK, act)
        assert torch.equal(block(got), order) and torch.equal(got, want)
        alone = x[2:3].clone()
        assert torch.equal(block(alone), order[2:3]) and torch.equal(alone[0], want[2])  # a row alone
    assert order.tolist() == [[0, 1, 2]] * 5
    assert block(x[:0].clone()).shape == (0, 3)  # an empty batch

    # what the blocks refuse, naming it: two rows at one cache entry, rope tables shorter than the cache, another
    # activation dtype
    with pytest.raises(ValueError, match="same \\(slot, position\\)"):
        native.CacheRows(torch.tensor([1, 1]), torch.tensor([0, 0]), 4, seq)
    with pytest.raises(ValueError, match="outside a cache of 4 x 16"):
        native.CacheRows(torch.tensor([1, 16]), torch.tensor([0, 0]), 4, seq)
    with pytest.raises(ValueError, match="rope tables"):
        native.AttnBlock(ln, 1e-6, w_qkv, quant, qn, kn, cos[:4], sin[:4], kc2, vc2, hq, w_o, quant, ops.CHUNK, act)
    with pytest.raises(ValueError, match="float16"):
        native.MoeBlock(ln, 1e-6, w_router, 3, True, w_gu, w_down, quant, quant, ops.CHUNK, torch.float16)
    nan = native.round_bf16(torch.tensor([float("nan"), 1.0 + 2**-9]))
    assert nan.view(torch.int32)[0] == 0x7FC00000 and nan[1] == 1.0  # c10's quiet NaN; a tie to even


def _rms_ref(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_gradients_are_those_of_the_references():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=g, requires_grad=True), torch.randn(8, 64, generator=g, requires_grad=True)
    ops.log_softmax(ops.linear(ops.rms_norm(x, torch.ones(64), 1e-6), w)).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = torch.log_softmax(_rms_ref(x, torch.ones(64), 1e-6) @ w.T, -1)
    ref.sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)

    # the one-pass backward kernels (RMSNorm with its weight, SiLU x up) against autograd of their formulas, and the
    # rounding point's straight-through gradient
    a, b = torch.randn(7, 48, generator=g, requires_grad=True), torch.randn(7, 48, generator=g, requires_grad=True)
    nw, up = torch.randn(48, generator=g, requires_grad=True), torch.randn(7, 48, generator=g)
    for fast, ref in ((lambda: ops.rms_norm(a, nw, 1e-6), lambda: _rms_ref(a, nw, 1e-6)),
                      (lambda: ops.silu_mul(a, b), lambda: torch.nn.functional.silu(a) * b)):
        got = torch.autograd.grad(fast(), (a, b, nw), up, allow_unused=True)
        want = torch.autograd.grad(ref(), (a, b, nw), up, allow_unused=True)
        assert all((p is None and q is None) or torch.allclose(p, q, atol=1e-5)
                   for p, q in zip(got, want, strict=True))
    (ga,) = torch.autograd.grad(ops.round_to(a * 3, torch.bfloat16), a, up)
    assert torch.equal(ga, up * 3)


def test_the_library_builds_with_the_documented_flags(tmp_path):
    start = time.time()
    path = native.build(Path(tmp_path))
    assert path.is_file() and time.time() - start < 120


def _generate(engine, prompts: list[list[int]], seeds: list[int], retract: bool = False,
              max_new: int = 14) -> list[tuple[list[int], list[float]]]:
    """Sample every prompt (temperature 1, its own seed); ``retract``: once every request has a few tokens, pause
    with retract (the KV cache dropped) and continue (each re-prefilled)."""
    import threading

    from megatron_qarl.serve.request import SamplingParams

    done = threading.Semaphore(0)
    reqs = []
    for p, s in zip(prompts, seeds, strict=True):
        req = engine.make_request(p, SamplingParams(max_new_tokens=max_new, sampling_seed=s, ignore_eos=True))
        req.on_done = lambda r: done.release()
        reqs.append(req)
    with engine.lock:  # admitted together: one batch
        for req in reqs:
            engine.submit(req)
    if retract:
        while min(len(r.output_ids) for r in reqs) < 4:
            time.sleep(0.001)
        engine.pause("retract")
        assert all(r.slot is None for r in reqs if r.finish_reason is None)
        engine.resume()
    for _ in reqs:
        assert done.acquire(timeout=120)
    assert not retract or any(r.num_retractions for r in reqs)
    return [(r.output_ids, r.output_logprobs) for r in reqs]


def test_a_request_alone_in_a_batch_and_after_a_retract_gets_the_same_bits(checkpoints):
    """The same tokens and log-prob bits alone, among 15 others, and re-prefilled after a retract; and the server's
    prefill of the sampled sequence (its prompt log-probs) equals what its decode reported."""
    from megatron_qarl.serve.engine import Engine, EngineConfig
    from megatron_qarl.serve.request import SamplingParams

    engine = Engine(EngineConfig(model_path=checkpoints["w4a16"], max_batch_size=16, max_seq_len=64,
                                 numerics="exact"))
    try:
        prompts = [t.tolist() for t in _tokens(16, 6, seed=4)]
        seeds = list(range(100, 116))
        alone = _generate(engine, prompts[:1], seeds[:1])[0]
        batch = _generate(engine, prompts, seeds)
        retracted = _generate(engine, prompts, seeds, retract=True)
        assert batch[0] == alone and retracted == batch
        ids, logps = alone
        req = engine.make_request(prompts[0] + ids, SamplingParams(max_new_tokens=1), return_logprob=True,
                                  logprob_start_len=0)
        import threading

        got = threading.Event()
        req.on_done = lambda r: got.set()
        engine.submit(req)
        assert got.wait(60)
        assert req.input_logprobs[len(prompts[0]):] == logps  # prefill == decode, bit for bit (as Python floats)
    finally:
        engine.shutdown()


def test_bf16_master_weights_with_w8a8_are_refused_under_exact_numerics():
    """Review finding: a bf16 master rounds the dequantized W8A8 weight to bf16, the server's stays float32, so the
    log-probs would differ; the rule refuses it naming model.dtype (W4A16's dequantized values fit bf16 exactly)."""
    from megatron_qarl.errors import ConfigError
    from megatron_qarl.preflight.rules import load_config

    for cfg in ("configs/cpu_w8a8_int8.yaml", "configs/cpu_w8a8_fp8.yaml"):
        with pytest.raises(ConfigError, match=r"^model\.dtype: 'bfloat16' .*numerics=exact"):
            load_config(cfg, ["numerics=exact", "model.dtype=bfloat16"])
        assert load_config(cfg, ["numerics=exact"]).model.dtype == "float32"
    assert load_config("configs/cpu_default.yaml", ["numerics=exact", "model.dtype=bfloat16"]).numerics == "exact"


def test_a_learner_built_off_the_cpu_is_refused_before_its_first_forward():
    """A CPU config started where CUDA is visible builds the learner on the GPU; ``exact_forward`` refuses it when
    the learner is built (naming the device and the key), not at the first forward after the servers started. The
    meta device stands in for CUDA here."""
    import types

    from megatron_qarl.moe.exact import exact_forward

    learner = types.SimpleNamespace(impl="local", routing_replay=False,
                                    module=torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"numerics: exact computes on the CPU.*parameters are on meta.*"
                                         r"CUDA_VISIBLE_DEVICES"):
        exact_forward("exact", learner, torch.bfloat16, None, True)
