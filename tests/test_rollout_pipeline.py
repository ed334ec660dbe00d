"""Asynchronous rollouts (megatron_qarl/train/pipeline.py) against a real embedded server (uvicorn, tiny model,
float32): a weight sync that lands mid-request (SGLang's pause_generation mode retract) gives each token the
version that sampled it and that version's log-prob, which is what the loss's batch carries; a sample older than
the staleness bound is regenerated, never handed to the step."""

from __future__ import annotations

import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import torch
from embedded_server import serve_in_thread
from safetensors.torch import load_file, save_file

from megatron_qarl.data.prompts import PromptStream
from megatron_qarl.preflight.rules import load_config
from megatron_qarl.rollout.engine import Engine, EngineConfig
from megatron_qarl.rollout.manager import RolloutServerError, parse_response, token_versions
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


def test_a_sample_older_than_max_staleness_is_regenerated_never_trained_on(server, model_dirs, tmp_path):
    from transformers import AutoTokenizer

    base, _ = server
    http = httpx.Client(base_url=base, timeout=60)
    _load(http, model_dirs[0], "v1")
    cfg = load_config(REPO / "configs" / "cpu_default.yaml", [
        "train.async=bounded", "train.max_staleness=2", "train.prompts_per_step=2", "rollout.sampling.n_samples=2",
        "rollout.sampling.max_new_tokens=4", "launch.backend=local", f"model.path={model_dirs[0]}", "train.steps=10",
        f"train.output_dir={tmp_path}"])
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[0], local_files_only=True)
    fleet = types.SimpleNamespace(urls=[base], alive=lambda: [True])
    rollouts = TrainRollouts(cfg, None, fleet, [1], on_sync=lambda report: None)
    stream = PromptStream(cfg.data, tokenizer)
    learner = {"version": 1}
    pipe = RolloutPipeline(cfg, rollouts, stream, None, version=lambda: learner["version"])
    try:
        first = pipe.take(1)
        assert first.regenerated == 0 and {v for g in first.groups for s in g for v in s.versions()} == {"v1"}
        pipe.ahead(1)  # steps 2 and 3 sampled now, at v1
        assert sorted(pipe.pending) == [2, 3]
        state_before_2 = pipe.pending[2].data_before
        assert pipe.data_state() == state_before_2  # a checkpoint now resumes at step 2's prompts
        for job in pipe.pending.values():
            job.future.result()

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


def test_r3_routes_of_positions_forwarded_before_a_retract_stay_those_of_the_sampling_version(private_tiny_copy,
                                                                                                   tmp_path):
    """R3 under bounded staleness: a request retracted across a weight update keeps, for every position already
    forwarded, the routes the sampling version used; the positions after come from the new version."""
    from megatron_qarl.rollout.request import SamplingParams

    model_dir = private_tiny_copy(tmp_path)
    tensors = load_file(Path(model_dir) / "model.safetensors")
    v2 = {k: -t for k, t in tensors.items() if k.endswith("mlp.gate.weight")}  # every router flipped
    engine = Engine(EngineConfig(model_path=model_dir, dtype="float32", max_batch_size=2, num_threads=1,
                                 enable_return_routed_experts=True))
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    def run(prompt, during=None):
        done = threading.Event()
        req = engine.make_request(prompt, params, return_routed_experts=True, on_done=lambda r: done.set())
        engine.submit(req)
        if during is not None:
            during(req)
        assert done.wait(60)
        return req

    try:
        straight = run(PROMPT)
        want_v1 = engine.routed_experts(straight)

        def sync_mid_request(req):
            while len(req.output_ids) < 4 and not req.finish_reason:
                time.sleep(0.001)
            engine.pause("retract")
            engine.weights.load_tensors(v2, "v2")
            engine.weights.finalize()
            engine.resume()

        forward = engine.model.forward_routed

        def slow(*args, **kw):
            time.sleep(0.02)
            return forward(*args, **kw)

        engine.model.forward_routed = slow
        try:
            spanning = run(PROMPT, sync_mid_request)
        finally:
            engine.model.forward_routed = forward
        (old, k), = spanning.version_events
        assert old == "default" and 4 <= k < 12 and spanning.num_retractions == 1
        routes = engine.routed_experts(spanning)
        forwarded = len(PROMPT) + k - 1  # positions forwarded under v1: the prompt and the first k - 1 outputs
        assert spanning.output_ids[:k] == straight.output_ids[:k]  # v1 sampled these
        assert torch.equal(routes[:forwarded], want_v1[:forwarded])
        # the new version routes those positions differently, so keeping them is a choice, not a coincidence
        v2_routes = engine.routed_experts(run(PROMPT + spanning.output_ids[:k]))
        assert not torch.equal(v2_routes[:forwarded], routes[:forwarded])
        assert torch.equal(routes[forwarded: forwarded + 1], v2_routes[forwarded: forwarded + 1])
    finally:
        engine.shutdown()
