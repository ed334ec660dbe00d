"""The FP8 KV cache (issue 54): the servers' cache in fp8_e4m3 / fp8_e5m2 with SGLang's write and read
(qat/kv_cache.py), the embedded engine holding it in one byte per element, and the learner's attention on the very
keys and values it reads back: bit for bit under ``numerics: exact`` (the learner's keys and values after the fake
quant are the engine's cache), to the fp8 grid under the default numerics (Megatron's core attention hooked, at TP 1
and TP 2 with sequence parallel), and a learner without the key computes on other keys and values."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.numerics import native, ops
from megatron_qarl.qat.kv_cache import FP8, KVCacheSpec, kv_load, kv_load_table, kv_round_trip, kv_store
from megatron_qarl.serve.model import Qwen3MoeEngineModel, cache_bytes_per_token, from_cache

FORMATS = ["fp8_e4m3", "fp8_e5m2"]


@dataclasses.dataclass(frozen=True)
class Recording(KVCacheSpec):
    """A spec that keeps every key / value it hands the attention: (layer, 0 key | 1 value, tensor)."""

    record: list = dataclasses.field(default_factory=list, compare=False)

    def round_trip(self, x, layer, which):
        y = super().round_trip(x, layer, which)
        self.record.append((layer, which, y.detach().clone()))
        return y


def _tokens(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 32, (rows, length), generator=torch.Generator().manual_seed(seed))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


# ------------------------------------------------------------------------------------------- the rounding
def test_the_round_trip_is_sglangs_cast_and_exact_c_computes_it_on_every_bf16_value():
    """store = fp8(act(x / s)) with torch's cast (round to nearest even; e4m3fn saturates a finite overflow and inf
    to 448, e5m2 rounds past 57344 to inf; NaN stays NaN), load = act(codes * s); exact.c's qx_kv_round gives the
    same bits for every bfloat16 value, in bf16 and float32, at scales 1, 0.37 and 2^-7."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    big = torch.tensor([1e6, float("inf"), -1e6, 464.0, 479.0, 61439.0, 61440.0, float("nan")])
    assert kv_store(big, 1.0, e4, torch.float32).float()[:5].tolist() == [448.0, 448.0, -448.0, 448.0, 448.0]
    assert kv_store(big, 1.0, e5, torch.float32).float()[:7].tolist() == [float("inf"), float("inf"), float("-inf"),
                                                                          448.0, 448.0, 57344.0, float("inf")]
    assert kv_store(big, 1.0, e4, torch.float32).float()[7].isnan()
    assert kv_store(big, 1.0, e5, torch.bfloat16)[7].isnan()
    # the division happens in the compute dtype: 0.1 / 3 in bf16 first, then e4m3 (a double rounding)
    x = torch.tensor([0.1], dtype=torch.bfloat16)
    assert torch.equal(kv_store(x, 3.0, e4, torch.bfloat16), (x.float() / 3.0).to(torch.bfloat16).to(e4))
    assert torch.equal(kv_load(kv_store(x, 3.0, e4, torch.bfloat16), 3.0, torch.bfloat16),
                       (kv_store(x, 3.0, e4, torch.bfloat16).float() * 3.0).to(torch.bfloat16))
    every_code = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # the engine's lookup is kv_load, bit for bit
    for name in FORMATS:
        for act in (torch.bfloat16, torch.float32):
            table, want = kv_load_table(FP8[name], 0.37, act), kv_load(every_code.view(FP8[name]), 0.37, act)
            assert torch.equal(_bits(table[every_code.long()]), _bits(want))
    every_bf16 = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    for name in FORMATS:
        for act in (torch.bfloat16, torch.float32):
            for scale in (1.0, 0.37, 2.0**-7):
                want = kv_round_trip(every_bf16, scale, FP8[name], act).float()
                got = native.kv_round(every_bf16, name, scale, act)
                same = (_bits(got) == _bits(want)) | (got.isnan() & want.isnan())
                assert same.all(), f"{name} {act} scale {scale}: {int((~same).sum())} values differ"


def test_the_learners_round_trip_passes_the_gradient_straight_through():
    spec = KVCacheSpec.build("fp8_e4m3", torch.bfloat16, 1)
    x = torch.randn(8, 4, requires_grad=True)
    y = spec.round_trip(x, 0, 0)
    assert y.dtype == torch.float32 and not torch.equal(y, x)
    assert torch.equal(y, kv_round_trip(x.detach(), 1.0, torch.float8_e4m3fn, torch.bfloat16).float())
    (y * torch.arange(4.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(4.0).expand(8, 4))


# -------------------------------------------------------------------------------- the engine's cache
def test_the_engines_fp8_cache_takes_half_the_bytes_and_holds_twice_the_sequences(tiny_model_dir):
    """One byte per element instead of bf16's two; under the same --kv-cache-mib, twice the slots."""
    made = {kv: Qwen3MoeEngineModel.from_model_dir(tiny_model_dir, torch.bfloat16, 64, 64, kv_cache_dtype=kv,
                                                   kv_cache_mib=0.125) for kv in ("auto", *FORMATS)}
    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    assert cache_bytes_per_token(made["auto"]) == 2 * per_token
    assert cache_bytes_per_token(made["fp8_e4m3"]) == cache_bytes_per_token(made["fp8_e5m2"]) == per_token
    assert made["auto"].slots == 2**17 // (2 * per_token * 64) == 2
    assert made["fp8_e4m3"].slots == made["fp8_e5m2"].slots == 4
    assert made["fp8_e4m3"].k_cache.dtype == torch.uint8


def test_a_prefill_reads_its_own_keys_from_the_fp8_cache_as_decode_does(tiny_model_dir):
    """The engine attends over what its cache reads back, the new tokens' keys too (SGLang's paged attention): a
    prefill's logits equal token-by-token decode's to float32 rounding, far below the e4m3 rounding's effect."""
    tokens, pos = _tokens(2, 20, seed=4), torch.arange(20)[None].expand(2, 20)
    prefill = {}
    for kv in ("fp8_e4m3", "auto"):
        m = Qwen3MoeEngineModel.from_model_dir(tiny_model_dir, torch.float32, 2, 32, kv_cache_dtype=kv)
        prefill[kv] = m.forward(tokens, torch.arange(2), pos, all_logits=True)
        steps = torch.stack([m.forward(tokens[:, t : t + 1], torch.arange(2), pos[:, t : t + 1])
                             for t in range(20)], dim=1)
        assert (prefill[kv] - steps).abs().max() <= 1e-4, kv
    assert (prefill["auto"] - prefill["fp8_e4m3"]).abs().max() > 1e-2


# ------------------------------------------------------------------------------ the learner, bit for bit
def _exact_learner(model_dir: str, kv: str, tokens: torch.Tensor) -> tuple[torch.Tensor, list]:
    from megatron_qarl.learner.rank import Learner

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=1, ep=1, seed=7)
    spec = Recording.build(kv, torch.bfloat16, arch.num_hidden_layers) if kv != "auto" else None
    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=1e-3), numerics="exact", act_dtype=torch.bfloat16,
                      kv_cache=spec)
    learner.load_hf(model_dir)
    logp = learner.forward_logprobs(tokens)
    if spec is not None:  # the split's unaware forward: the auto learner's bits
        return logp, list(spec.record), learner.forward_logprobs(tokens, kv_cache=False)
    return logp, [], logp


def _engine_logprobs(model: Qwen3MoeEngineModel, tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    logits = model.forward(tokens, torch.arange(b), torch.arange(s)[None].expand(b, s), all_logits=True)
    return ops.log_softmax(logits[:, :-1]).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize("kv", FORMATS)
def test_the_learners_keys_and_values_are_the_engines_cache_bit_for_bit(kv, tiny_model_dir):
    """numerics: exact, bf16 servers, the same tokens and weights: every key and value the learner's attention
    takes after the fake quant equals what the engine stored in its cache and reads back, bit for bit, and the
    log-probs are equal; a learner without the key (its keys as computed, which the auto-cache engine holds) has
    other keys and values and other log-probs."""
    tokens = _tokens(3, 24, seed=5)
    b, s = tokens.shape
    engine = Qwen3MoeEngineModel.from_model_dir(tiny_model_dir, torch.bfloat16, b, 32, numerics="exact",
                                                kv_cache_dtype=kv)
    want = _engine_logprobs(engine, tokens)
    got, record, unaware_forward = run_ranks(1, _exact_learner, tiny_model_dir, kv, tokens)[0]
    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    assert len(record) == 2 * arch.num_hidden_layers
    for layer, which, t in record:
        cache = (engine.k_cache if which == 0 else engine.v_cache)[layer, :, :, :s]  # [B, Hkv, S, D]
        mine = t.reshape(b, s, arch.num_key_value_heads, arch.head_dim).transpose(1, 2)
        assert torch.equal(_bits(mine), _bits(cache)), f"layer {layer} {'kv'[which]}: {int((mine != cache).sum())}"
        grid = kv_round_trip(cache, 1.0, FP8[kv], torch.bfloat16).float()
        assert torch.equal(grid, cache)  # the cache holds values of the fp8 grid: reading them back changes none
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} log-probs differ"

    plain = Qwen3MoeEngineModel.from_model_dir(tiny_model_dir, torch.bfloat16, b, 32, numerics="exact")
    unaware, *_ = run_ranks(1, _exact_learner, tiny_model_dir, "auto", tokens)[0]
    assert torch.equal(unaware, _engine_logprobs(plain, tokens))  # its keys are the auto cache's
    assert torch.equal(unaware_forward, unaware)  # forward_logprobs(kv_cache=False), the mismatch split's KV part
    assert not torch.equal(plain.k_cache[:, :, :, :s], engine.k_cache[:, :, :, :s])
    assert not torch.equal(plain.v_cache[:, :, :, :s], engine.v_cache[:, :, :, :s])
    assert int((unaware != want).sum()) > got.numel() // 2


# ------------------------------------------------------------------ the learner's Megatron attention, hooked
def _hooked_learner(model_dir: str, tp: int, kv: str | None, tokens: torch.Tensor) -> dict:
    import torch.distributed as dist

    from megatron_qarl.learner.rank import Learner

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=1, seed=7)
    spec = Recording.build(kv, torch.float32, arch.num_hidden_layers) if kv else None
    learner = Learner(arch, ParallelConfig(tp=tp), OptimConfig(lr=1e-3), kv_cache=spec)
    learner.load_hf(model_dir)
    return {"rank": dist.get_rank(), "logp": learner.forward_logprobs(tokens),
            "record": list(spec.record) if spec is not None else [],
            "unaware": learner.forward_logprobs(tokens, kv_cache=False)}


@pytest.mark.multiproc
def test_megatrons_core_attention_takes_the_engines_keys_and_values_at_tp1_and_tp2_with_sp(tiny_model_dir):
    """Default numerics, float32 on both sides, the local spec: the keys and values Megatron's core attention takes
    (after the k-norm and rotary embedding) are the engine's read-back cache, each rank's heads at TP 2 with sequence
    parallel (elements whose float32 keys straddle an e4m3 rounding boundary may take the neighbouring code: at most
    1 in 1000, one fp8 step apart), and the log-probs agree as float32 servers agree; unaware, they differ by the
    rounding."""
    tokens = _tokens(4, 30, seed=6)
    b, s = tokens.shape
    arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
    engine = Qwen3MoeEngineModel.from_model_dir(tiny_model_dir, torch.float32, b, 32, kv_cache_dtype="fp8_e4m3")
    want = _engine_logprobs(engine, tokens)
    hkv, d = arch.num_key_value_heads, arch.head_dim
    first = {}
    for tp in (1, 2):
        for out in run_ranks(tp, _hooked_learner, tiny_model_dir, tp, "fp8_e4m3", tokens):
            first.setdefault(tp, out)
            assert len(out["record"]) == 2 * arch.num_hidden_layers
            heads = slice(out["rank"] * hkv // tp, (out["rank"] + 1) * hkv // tp)
            for layer, which, t in out["record"]:
                assert t.shape[1:] == (b, hkv // tp, d)  # Megatron's [S, B, local KV heads, D]
                mine = t[:s].permute(1, 2, 0, 3)
                cache = from_cache((engine.k_cache if which == 0 else engine.v_cache)[layer, :, heads, :s],
                                   engine.kv_tables[layer][which])
                off = mine != cache
                assert int(off.sum()) <= mine.numel() // 1000, f"TP{tp} layer {layer}: {int(off.sum())} differ"
                step = cache.abs().clamp_min(2.0**-6) / 8  # an e4m3 step at that magnitude
                assert ((mine - cache).abs() <= step)[off].all()
            assert (out["logp"] - want).abs().mean() <= 1e-5 and (out["logp"] - want).abs().max() <= 1e-2
    unaware = run_ranks(1, _hooked_learner, tiny_model_dir, 1, None, tokens)[0]["logp"]
    assert (unaware - want).abs().mean() > 1e-2
    out = first[1]
    assert torch.equal(out["unaware"], unaware)  # forward_logprobs(kv_cache=False): the hook off, the same bits
    from megatron_qarl.train.pipeline import kv_cache_split

    split = kv_cache_split(out["logp"], out["unaware"], torch.ones(b, s - 1))
    assert split["mismatch_kv/mismatch_tok_abs_mean"] == pytest.approx(float((unaware - out["logp"]).abs().mean()))


# ------------------------------------------------------------------ the weight sync and R3 with an FP8 cache
def _run(engine, prompts: list[list[int]]) -> list:
    import threading

    from megatron_qarl.serve.request import SamplingParams

    done = threading.Semaphore(0)
    reqs = [engine.make_request(p, SamplingParams(temperature=1.0, max_new_tokens=10, sampling_seed=5 + i),
                                return_logprob=True, return_routed_experts=True, on_done=lambda r: done.release())
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=120), "engine did not finish"
    return [(r.output_ids, r.output_logprobs, engine.routed_experts(r)) for r in reqs]


def test_a_weight_update_and_r3_routes_work_unchanged_with_an_fp8_cache(tiny_model_dir, tmp_path):
    """An embedded engine with an FP8 cache and R3 on: its samples, log-probs and routes after a weight update equal
    those of an engine started from the new weights (the cache is rewritten by every prefill), and differ from
    the ones before the update."""
    from safetensors.torch import save_file

    from megatron_qarl.qat.export import iter_safetensors
    from megatron_qarl.serve.engine import Engine, EngineConfig

    new = tmp_path / "new"
    new.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        if f.suffix != ".safetensors":
            (new / f.name).symlink_to(f)
    changed = {n: (t * 0.8 if ".experts." in n or "k_norm" in n else t) for n, t in iter_safetensors(tiny_model_dir)}
    save_file(changed, str(new / "model.safetensors"))
    cfg = dict(dtype="float32", max_batch_size=4, enable_return_routed_experts=True, kv_cache_dtype="fp8_e4m3")
    engine = Engine(EngineConfig(model_path=tiny_model_dir, **cfg))
    fresh = Engine(EngineConfig(model_path=str(new), **cfg))
    prompts = [[2, 5, 6, 7, 8], [2, 9, 10], [2, 11, 12, 13, 14, 15, 16]]
    try:
        before = _run(engine, prompts)
        engine.weights.update_tensors(changed, "v2")
        after, want = _run(engine, prompts), _run(fresh, prompts)
    finally:
        engine.shutdown()
        fresh.shutdown()
    for (ids, logp, routes), (w_ids, w_logp, w_routes) in zip(after, want, strict=True):
        assert ids == w_ids and logp == w_logp and torch.equal(routes, w_routes)
        assert routes.shape[1:] == (4, 2)  # [positions, layers, top-k]
    assert [a[1] for a in after] != [b[1] for b in before]


# ------------------------------------------------------------------------------------------- the run key
def test_the_run_key_loads_with_sglang_and_the_embedded_server_and_is_refused_naming_the_keys_elsewhere():
    """rollout.kv_cache_dtype: SGLang and the embedded server take it (the learner aligned or not); vLLM's FP8 cache
    rounds otherwise (measured: docs/rollout.md) and an exact learner must read the servers' keys: refused at load,
    the message starting with the key at fault."""
    from megatron_qarl.errors import ConfigError
    from megatron_qarl.preflight.rules import load_config

    base = Path(__file__).resolve().parents[1] / "configs" / "cpu_default.yaml"
    for kv in FORMATS:
        assert load_config(base, [f"rollout.kv_cache_dtype={kv}"]).rollout.kv_cache_dtype == kv
        load_config(base, [f"rollout.kv_cache_dtype={kv}", "learner.aligned=false"])
        load_config(base, [f"rollout.kv_cache_dtype={kv}", "rollout.backend=sglang", "rollout.gpus_per_server=1"])
        load_config(base, [f"rollout.kv_cache_dtype={kv}", "numerics=exact", "launch.backend=local"])
        with pytest.raises(ConfigError, match=rf"^rollout\.kv_cache_dtype: {kv} with rollout\.backend=vllm: .*worse|"
                                              rf"^rollout\.kv_cache_dtype: {kv} with rollout\.backend=vllm: .*exceeds"):
            load_config(base, [f"rollout.kv_cache_dtype={kv}", "rollout.backend=vllm"])
        with pytest.raises(ConfigError, match=r"^learner\.aligned: false with rollout\.kv_cache_dtype=fp8_e\dm\d and "
                                              r"numerics=exact"):
            load_config(base, [f"rollout.kv_cache_dtype={kv}", "numerics=exact", "launch.backend=local",
                               "learner.aligned=false", "quant.scheme=bf16"])
    with pytest.raises(ConfigError, match=r"^rollout\.kv_cache_dtype: .*fp8_e4m3"):
        load_config(base, ["rollout.kv_cache_dtype=fp16"])
    assert load_config(base, ["rollout.backend=vllm"]).rollout.kv_cache_dtype == "auto"
