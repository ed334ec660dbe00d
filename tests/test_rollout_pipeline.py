"""Asynchronous rollouts (megatron_qarl/train/pipeline.py) against a real embedded server (uvicorn, tiny model,
float32): a weight sync that lands mid-request (SGLang's pause_generation mode retract) gives each token the
version that sampled it and that version's log-prob, which is what the loss's batch carries; a sample older than
the staleness bound is regenerated, never handed to the step."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import torch
from embedded_server import serve_in_thread
from safetensors.torch import load_file, save_file

from megatron_qarl.algo.routing import decode_routed_experts
from megatron_qarl.data.prompts import PromptStream
from megatron_qarl.preflight.rules import load_config
from megatron_qarl.rollout.client import SGLangClient
from megatron_qarl.rollout.manager import (
    RolloutManager,
    RolloutServerError,
    RoutesSpec,
    SamplingConfig,
    parse_response,
    token_versions,
)
from megatron_qarl.serve.engine import Engine, EngineConfig
from megatron_qarl.sync.weight_update import Engine as Endpoint
from megatron_qarl.sync.weight_update import WeightUpdateAPI
from megatron_qarl.train.pipeline import RolloutPipeline, sample_staleness, staleness_metrics
from megatron_qarl.train.rollouts import TrainRollouts
from megatron_qarl.train.trainer import build_batch

REPO = Path(__file__).resolve().parents[1]
PROMPT = [2, 19, 20, 6, 15, 16, 18, 4, 11]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, private_tiny_copy) -> tuple[str, str]:
    """(the tiny model, the same with lm_head x 1.5: another weight version whose log-probs differ)."""
    base = private_tiny_copy(tmp_path_factory.mktemp("v1"))
    other = Path(private_tiny_copy(tmp_path_factory.mktemp("v2")))
    tensors = load_file(other / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.5
    save_file(tensors, other / "model.safetensors")
    return base, str(other)


@pytest.fixture(scope="module")
def server(model_dirs):
    engine = Engine(EngineConfig(model_path=model_dirs[0], dtype="float32", max_batch_size=8, num_threads=1))
    with serve_in_thread(engine) as url:
        yield url, engine


def _load(http: httpx.Client, model_dir: str, version: str) -> None:
    r = http.post("/update_weights_from_disk", json={"model_path": model_dir, "weight_version": version})
    assert r.status_code == 200 and r.json()["success"], r.text


def _rescore(http: httpx.Client, prompt: list[int], response: list[int]) -> list[float]:
    """The server's log-probs of ``response`` after ``prompt`` under the weights it holds (one prefill)."""
    meta = http.post("/generate", json={"input_ids": prompt + response, "return_logprob": True,
                                        "logprob_start_len": len(prompt),
                                        "sampling_params": {"temperature": 1.0, "max_new_tokens": 1}}).json()
    return [t[0] for t in meta["meta_info"]["input_token_logprobs"]][: len(response)]


def test_sync_mid_request_each_token_has_its_version_and_the_loss_its_behaviour_logprob(server, model_dirs):
    base, engine = server
    http = httpx.Client(base_url=base, timeout=60)
    _load(http, model_dirs[0], "v1")
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 7}}
    result: dict = {}
    forward = engine.model.forward

    def slow(*args, **kw):  # every step a little longer: the sync surely lands mid-request
        time.sleep(0.03)
        return forward(*args, **kw)

    engine.model.forward = slow
    try:
        thread = threading.Thread(target=lambda: result.update(r=httpx.post(f"{base}/generate", json=body,
                                                                             timeout=120).json()))
        thread.start()
        deadline = time.monotonic() + 30
        while not any(len(r.output_ids) >= 4 for r in engine.scheduler.running()):
            assert time.monotonic() < deadline and thread.is_alive(), "the request never got going"
            time.sleep(0.005)
        # the trainer's sync, as sync/broadcaster.py runs it in bounded mode (a disk load stands in for the
        # broadcast buckets: the engine swaps weights the same way, between two steps)
        api = WeightUpdateAPI(Endpoint(base))
        api.pause_generation("retract")
        api.flush_cache()  # SGLang flushes a paused engine whose requests were retracted
        _load(http, model_dirs[1], "v2")
        api.continue_generation()
        thread.join(timeout=120)
    finally:
        engine.model.forward = forward
    meta = result["r"]["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["v1", "v2"], spans
    k = spans[0]["end"]
    assert 4 <= k < 24 and spans == [{"version": "v1", "start": 0, "end": k}, {"version": "v2", "start": k, "end": 24}]
    assert meta["weight_version"] == "v2" and meta["num_retractions"] == 1

    sample = parse_response(result["r"], 0, 0, PROMPT, base)
    assert sample.versions() == ["v1"] * k + ["v2"] * (24 - k)
    new_lp = _rescore(http, PROMPT, sample.response_ids)  # the server holds v2 now
    _load(http, model_dirs[0], "v1")
    old_lp = _rescore(http, PROMPT, sample.response_ids)
    behaviour = torch.tensor(old_lp[:k] + new_lp[k:])
    # each token's sampler log-prob is the version's that sampled it (retract rebuilt the cache under v2) ...
    assert torch.allclose(torch.tensor(sample.logp_sampler), behaviour, atol=1e-5), \
        (sample.logp_sampler, behaviour.tolist())
    assert (torch.tensor(old_lp) - torch.tensor(new_lp)).abs().max() > 1e-2  # the versions really differ
    # ... and the batch the loss receives carries exactly those as logp_sampler_BT (the behaviour policy)
    batch, logp_sampler_BT = build_batch([[sample]], pad_id=0)
    got = logp_sampler_BT[0][batch.loss_mask_BT[0] > 0]
    assert torch.allclose(got, behaviour, atol=1e-5)
    assert sample_staleness(sample, learner_version=3) == 2  # the oldest token counts
    m, ages = staleness_metrics([[sample]], learner_version=2, bound=2)
    assert ages == [1] * k + [0] * (24 - k) and m["staleness/samples_spanning"] == 1.0


def test_weight_versions_spans_must_tile_the_output():
    assert token_versions([{"version": "v3", "start": 0, "end": 2}, {"version": "v4", "start": 2, "end": 3}], 3,
                          "x") == ["v3", "v3", "v4"]
    with pytest.raises(RolloutServerError, match="x: weight_versions spans cover 2 of 3"):
        token_versions([{"version": "v3", "start": 0, "end": 2}], 3, "x")
    with pytest.raises(RolloutServerError, match="do not tile"):
        token_versions([{"version": "v3", "start": 1, "end": 3}], 3, "x")


def _bounded_pipeline(url: str, model_dir: str, tmp_path, version, *overrides: str) -> RolloutPipeline:
    """train.async=bounded(2) on the module's server at ``url`` holding ``model_dir`` as v1: 2 prompts x 2 samples of
    4 tokens a step; ``version()`` the learner's weight version."""
    from transformers import AutoTokenizer

    _load(httpx.Client(base_url=url, timeout=60), model_dir, "v1")
    cfg = load_config(REPO / "configs" / "cpu_default.yaml", [
        "train.async=bounded", "train.max_staleness=2", "train.prompts_per_step=2", "rollout.sampling.n_samples=2",
        "rollout.sampling.max_new_tokens=4", "launch.backend=local", f"model.path={model_dir}", "train.steps=10",
        f"train.output_dir={tmp_path}", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    fleet = types.SimpleNamespace(urls=[url], alive=lambda: [True])
    rollouts = TrainRollouts(cfg, None, fleet, [1], on_sync=lambda report: None)
    return RolloutPipeline(cfg, rollouts, PromptStream(cfg.data, tokenizer), None, version=version)


def test_a_sample_older_than_max_staleness_is_regenerated_never_trained_on(server, model_dirs, tmp_path):
    base, _ = server
    http = httpx.Client(base_url=base, timeout=60)
    learner = {"version": 1}
    pipe = _bounded_pipeline(base, model_dirs[0], tmp_path, lambda: learner["version"])
    try:
        first = pipe.take(1)
        assert first.regenerated == 0 and {v for g in first.groups for s in g for v in s.versions()} == {"v1"}
        pipe.ahead(1)  # steps 2 and 3 sampled now, at v1
        assert sorted(pipe.pending) == [2, 3]
        state_before_2 = pipe.pending[2].data_before
        assert pipe.data_state() == state_before_2  # a checkpoint now resumes at step 2's prompts
        for job in pipe.pending.values():
            job.future.result(timeout=300)

        learner["version"] = 3  # step 2 trains at v3: its v1 samples are 2 behind, within the bound
        two = pipe.take(2)
        assert two.regenerated == 0
        assert staleness_metrics(two.groups, 3, 2)[0]["staleness/token_max"] == 2.0

        learner["version"] = 4  # step 3 trains at v4: its v1 samples are 3 behind: over the bound
        _load(http, model_dirs[1], "v4")
        three = pipe.take(3)
        assert three.regenerated == 4  # every one of them, sampled again at v4
        versions = {v for g in three.groups for s in g for v in s.versions()}
        assert versions == {"v4"}
        assert all(sample_staleness(s, 4) <= 2 for g in three.groups for s in g)
        assert [len(g) for g in three.groups] == [2, 2]  # groups stay whole
    finally:
        pipe.close()


def _learner_logprobs(model_dir: str, tokens_BS: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    """An fp32 learner's log-probs of ``tokens_BS`` at the sampling temperature and unscaled (one rank)."""
    from megatron_qarl.config import OptimConfig, ParallelConfig
    from megatron_qarl.learner.rank import Learner
    from megatron_qarl.moe.model import Qwen3MoeArch
    from megatron_qarl.moe.parallelize import init_parallel

    init_parallel()
    learner = Learner(Qwen3MoeArch.from_model_dir(model_dir), ParallelConfig(), OptimConfig(), temperature=temperature)
    learner.load_hf(model_dir)
    return learner.forward_logprobs(tokens_BS), learner.forward_logprobs(tokens_BS, temperature=1.0)


def test_the_mismatch_split_compares_like_with_like_at_temperature_0_8(server, model_dirs, tmp_path):
    """At T = 0.8 (the 30B configs) with float32 on both sides and no staleness, both parts of the split stay at
    numerics (<= 1e-5 per token): the rescore reads SGLang's input log-probs, which are unscaled at any T, and is
    compared with the learner's unscaled log-probs. Compared with the learner's T-scaled ones, as before the fix,
    the 'quantization' part measured the temperature."""
    from megatron_qarl.moe.parallelize import run_ranks
    from megatron_qarl.train.pipeline import mismatch_split, rescored_BT

    base, _ = server
    http = httpx.Client(base_url=base, timeout=60)
    _load(http, model_dirs[0], "v1")
    cfg = load_config(REPO / "configs" / "cpu_default.yaml", [
        "rollout.sampling.temperature=0.8", "launch.backend=local", f"model.path={model_dirs[0]}",
        f"train.output_dir={tmp_path}"])
    rollouts = TrainRollouts(cfg, None, types.SimpleNamespace(urls=[base], alive=lambda: [True]), [1],
                             on_sync=lambda report: None)
    sampling = SamplingConfig(n_samples=2, temperature=0.8, max_new_tokens=8)
    groups, _ = rollouts.rollout([PROMPT, PROMPT[:5]], sampling, 3)
    rescored = rollouts.rescore(groups)
    batch, logp_sampler_BT = build_batch(groups, pad_id=0)
    logp_old_BT, unscaled_BT = run_ranks(1, _learner_logprobs, model_dirs[0], batch.tokens_BS, 0.8)[0]
    mask = batch.loss_mask_BT
    rescored_at = rescored_BT(groups, rescored, tuple(logp_sampler_BT.shape))
    m = mismatch_split(logp_old_BT, unscaled_BT, rescored_at, logp_sampler_BT, mask)
    assert m["mismatch_quant/mismatch_tok_abs_p99"] <= 1e-5 and m["mismatch_stale/mismatch_tok_abs_p99"] <= 1e-5, m
    assert (logp_old_BT - logp_sampler_BT)[mask > 0].abs().max() <= 1e-5  # the sampler's are T-scaled, as the loss's
    assert (logp_old_BT - rescored_at)[mask > 0].abs().mean() > 1e-2  # T-scaled vs unscaled: the old comparison


@pytest.fixture(scope="module")
def r3_dirs(tmp_path_factory, private_tiny_copy) -> tuple[str, str]:
    """(the tiny model without an EOS id, so that requests run to their budget; the same with every router
    flipped: a second weight version that routes every position differently)."""
    import json

    base = Path(private_tiny_copy(tmp_path_factory.mktemp("r3_v1")))
    for name in ("config.json", "generation_config.json"):
        conf = json.loads((base / name).read_text())
        conf.pop("eos_token_id", None)
        (base / name).write_text(json.dumps(conf))
    flipped = Path(private_tiny_copy(tmp_path_factory.mktemp("r3_v2")))
    tensors = load_file(flipped / "model.safetensors")
    save_file({k: -t if k.endswith("mlp.gate.weight") else t for k, t in tensors.items()},
              flipped / "model.safetensors")
    return str(base), str(flipped)


@contextlib.contextmanager
def _slow_routed(engine, seconds: float = 0.02):
    """Every routed forward a little longer, so that a sync surely lands mid-request."""
    forward = engine.model.forward_routed

    def slow(*args, **kw):
        time.sleep(seconds)
        return forward(*args, **kw)

    engine.model.forward_routed = slow
    try:
        yield
    finally:
        engine.model.forward_routed = forward


def _sync_mid_request(base: str, engine, model_dir: str, version: str, mode: str, after: int = 4) -> None:
    """The trainer's sync as sync/broadcaster.py runs it while a request is running with ``after`` tokens out:
    pause (``mode``), flush, new weights (a disk load stands in for the broadcast buckets), continue."""
    deadline = time.monotonic() + 30
    while not any(len(r.output_ids) >= after for r in engine.scheduler.running()):
        assert time.monotonic() < deadline, "the request never got going"
        time.sleep(0.002)
    api = WeightUpdateAPI(Endpoint(base))
    api.pause_generation(mode)
    api.flush_cache()
    _load(httpx.Client(base_url=base, timeout=60), model_dir, version)
    api.continue_generation()


def _routes(http: httpx.Client, seq: list[int], spec: RoutesSpec) -> torch.Tensor:
    """The routes the server's weights give every position of ``seq`` but the last (one prefill), sorted per token."""
    out = http.post("/generate", json={"input_ids": seq, "return_routed_experts": True,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 1}}).json()
    routes = decode_routed_experts(out["meta_info"]["routed_experts"], len(seq) + 1, spec.layers, spec.topk,
                                   spec.num_experts, "reference")
    return routes[: len(seq) - 1].sort(-1).values


def test_r3_after_a_retract_every_route_is_recomputed_as_sglangs(r3_dirs):
    """SGLang 0.5.23 (Req.reset_for_retract sets routed_experts to None; the capturer keeps routes per KV slot, and
    the re-prefill recomputes every slot): a request retracted across a weight update answers the NEW version's
    routes for every position, including those whose next token the old version sampled. The engine did the
    opposite before (it kept the old routes, so R3 replayed one thing in the tests and another in production)."""
    engine = Engine(EngineConfig(model_path=r3_dirs[0], dtype="float32", max_batch_size=2, num_threads=1,
                                 enable_return_routed_experts=True))
    spec = RoutesSpec(*_arch_routes(r3_dirs[0]))
    body = {"input_ids": PROMPT, "return_routed_experts": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    with serve_in_thread(engine) as base:
        http = httpx.Client(base_url=base, timeout=60)
        _load(http, r3_dirs[0], "v1")
        result: dict = {}
        with _slow_routed(engine):
            thread = threading.Thread(target=lambda: result.update(r=httpx.post(f"{base}/generate", json=body,
                                                                                 timeout=120).json()))
            thread.start()
            _sync_mid_request(base, engine, r3_dirs[1], "v2", "retract")
            thread.join(timeout=120)
        meta = result["r"]["meta_info"]
        k = meta["weight_versions"][0]["end"]
        assert meta["num_retractions"] == 1 and [s["version"] for s in meta["weight_versions"]] == ["v1", "v2"]
        seq = PROMPT + result["r"]["output_ids"]
        routes = decode_routed_experts(meta["routed_experts"], len(seq), spec.layers, spec.topk, spec.num_experts,
                                       "retracted").sort(-1).values
        v2 = _routes(http, seq, spec)
        _load(http, r3_dirs[0], "v1")
        v1 = _routes(http, seq, spec)
    forwarded = len(PROMPT) + k - 1  # positions forwarded under v1 before the retract
    assert torch.equal(routes, v2)  # every one of them recomputed under v2
    assert not torch.equal(v1[:forwarded], v2[:forwarded])  # which really differs from the sampling version's


def test_r3_under_bounded_staleness_every_segment_keeps_the_routes_it_was_sampled_under(r3_dirs):
    """R3 exact per segment under SGLang's semantics: with routes wanted, the bounded pipeline's sync aborts the
    running requests (QarlConfig.sync_pause_mode) and the rollout manager continues each as a new request; the
    stitched sample's tokens, log-probs, versions and routes are each segment's: the positions that sampled
    tokens under v1 carry v1's routes, the rest v2's."""
    cfg = load_config(REPO / "configs" / "cpu_default.yaml", ["train.async=bounded", "algo.routing_replay=true",
                                                              f"model.path={r3_dirs[0]}"])
    engine = Engine(EngineConfig(model_path=r3_dirs[0], dtype="float32", max_batch_size=2, num_threads=1,
                                 enable_return_routed_experts=True))
    spec = RoutesSpec(*_arch_routes(r3_dirs[0]))
    manager = RolloutManager(SamplingConfig(n_samples=1, temperature=1.0, max_new_tokens=20), [], seed=5,
                             routes=spec, max_idle_aborts=cfg.train.staleness_bound + 1)
    with serve_in_thread(engine) as base:
        http = httpx.Client(base_url=base, timeout=60)
        _load(http, r3_dirs[0], "v1")
        result: dict = {}

        async def rollout():
            async with SGLangClient(base) as client:
                return await manager.generate([client], [PROMPT], step=1)

        with _slow_routed(engine):
            thread = threading.Thread(target=lambda: result.update(groups=asyncio.run(rollout())))
            thread.start()
            _sync_mid_request(base, engine, r3_dirs[1], "v2", cfg.sync_pause_mode)
            thread.join(timeout=120)
        ((sample,),) = result["groups"]
        seq = PROMPT + sample.response_ids
        v2, new_lp = _routes(http, seq, spec), _rescore(http, PROMPT, sample.response_ids)
        _load(http, r3_dirs[0], "v1")
        v1, old_lp = _routes(http, seq, spec), _rescore(http, PROMPT, sample.response_ids)
    k = sample.versions().count("v1")
    assert cfg.sync_pause_mode == "abort" and manager.continued == 1 and sample.finish_reason == "length"
    assert 4 <= k < 20 and sample.versions() == ["v1"] * k + ["v2"] * (20 - k)
    cut = len(PROMPT) + k - 1  # positions whose forward sampled a v1 token: the prompt's last and outputs 1..k-1
    routes = sample.routes.sort(-1).values
    assert torch.equal(routes[:cut], v1[:cut]) and torch.equal(routes[cut:], v2[cut:])
    assert not torch.equal(v1[:cut], v2[:cut]) and not torch.equal(v1[cut:], v2[cut:])  # the versions differ
    assert torch.allclose(torch.tensor(sample.logp_sampler), torch.tensor(old_lp[:k] + new_lp[k:]), atol=1e-5)


def _arch_routes(model_dir: str) -> tuple[int, int, int]:
    from megatron_qarl.moe.model import Qwen3MoeArch

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    return arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts


def test_close_after_an_error_cancels_the_rollouts_in_flight_instead_of_waiting_for_them(server, model_dirs,
                                                                                         tmp_path):
    """After an error or a stop signal the trainer closes the pipeline with ``abort``: bounded mode's rollouts in
    flight, whose requests are parked on a paused server (a sync that failed half-way), are cancelled at once.
    Before issue 38 close waited for them: rollout.timeout_s x retries per request, whole rollouts of them."""
    base, _ = server
    http = httpx.Client(base_url=base, timeout=60)
    pipe = _bounded_pipeline(base, model_dirs[0], tmp_path, lambda: 1, "rollout.timeout_s=300")
    assert http.post("/pause_generation", json={"mode": "retract"}).json()["success"]
    try:
        pipe.ahead(0)  # steps 1 and 2: their requests wait on the paused server
        jobs = list(pipe.pending.values())
        deadline = time.monotonic() + 30
        while engine_waiting(server[1]) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine_waiting(server[1]) >= 4, "the rollouts' requests did not reach the paused server"
        start = time.monotonic()
        pipe.close(abort=True)
        took = time.monotonic() - start
    finally:
        http.post("/continue_generation")
    print(f"\nclose(abort=True) with {len(jobs)} rollouts parked on a paused server: {took:.2f} s")
    assert took < 20
    assert all(isinstance(job.future.exception(), asyncio.CancelledError) for job in jobs)
    assert not pipe.pending


def engine_waiting(engine) -> int:
    """Requests the engine holds, waiting or running."""
    return engine.scheduler.num_pending()
