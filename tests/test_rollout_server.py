"""Protocol suite for ``qarl serve``: SGLang's field names and response shapes over real HTTP (uvicorn on
127.0.0.1), the admin endpoints, auth off loopback, and 4xx (never 5xx) for bad input."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from embedded_server import serve_in_thread

from megatron_qarl.errors import UserError
from megatron_qarl.serve.engine import Engine, EngineConfig
from megatron_qarl.serve.server import ServerConfig, build_app

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, private_tiny_copy) -> str:
    return private_tiny_copy(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(model_dir):
    """(base URL, engine) of a real uvicorn server on a free loopback port."""
    engine = Engine(EngineConfig(model_path=model_dir, dtype="float32", max_batch_size=4))
    with serve_in_thread(engine) as url:
        yield url, engine


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


PROMPT = [2, 19, 20, 6, 15, 16, 18, 4, 11]  # arbitrary in-vocabulary ids


def gen(http, **body) -> httpx.Response:
    body.setdefault("input_ids", PROMPT)
    return http.post("/generate", json=body)


def test_health_and_model_info(http):
    assert http.get("/health").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] and info["weight_version"] == "default"


def test_generate_response_has_sglang_shape(http):
    r = gen(http, sampling_params={"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}, return_logprob=True)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 5
    assert isinstance(meta["id"], str) and meta["weight_version"] == "default"
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
    assert all(isinstance(t[0], float) and t[0] <= 0.0 for t in triples)
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only
    assert "output_token_logprobs" not in gen(http, sampling_params={"max_new_tokens": 1}).json()["meta_info"]


def test_batched_input_and_per_prompt_params(http):
    prompts = [PROMPT, PROMPT[:4], [2, 5]]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (1, 2, 3)]
    out = gen(http, input_ids=prompts, sampling_params=params).json()
    assert isinstance(out, list) and [o["meta_info"]["completion_tokens"] for o in out] == [1, 2, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [9, 4, 2]
    single = gen(http, input_ids=PROMPT[:4], sampling_params=params[1]).json()
    assert out[1]["output_ids"] == single["output_ids"]  # fp32 greedy: batching changes nothing


def test_stop_token_ids_and_eos(http):
    free = gen(http, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}).json()
    stop = free["output_ids"][2]
    first = free["output_ids"].index(stop)
    out = gen(http, sampling_params={"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop],
                                     "ignore_eos": True}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == free["output_ids"][: first + 1]  # the matched token is part of the output


def test_sampling_seed_reproduces(http):
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 12, "sampling_seed": 1234,
              "ignore_eos": True}
    a, b = (gen(http, sampling_params=params, return_logprob=True).json() for _ in range(2))
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    others = {tuple(gen(http, sampling_params={**params, "sampling_seed": s}).json()["output_ids"]) for s in range(6)}
    assert len(others) > 1  # different seeds give different samples


def test_output_logprobs_are_temperature_scaled_and_prompt_logprobs_are_not(server, http):
    """SGLang 0.5.23: output_token_logprobs = log_softmax(logits / T) of the sampled token, before top-k / top-p
    (sglang/srt/layers/sampler.py); input_token_logprobs = log_softmax(logits), the raw logits whatever the
    temperature (sglang/srt/layers/logprob_processor.py, InputLogprobProcessor). Before the fix the prompt's were
    scaled by T too, so a rescore through them measured the temperature."""
    _, engine = server
    t = 0.7
    out = gen(http, sampling_params={"temperature": t, "max_new_tokens": 6, "sampling_seed": 5, "ignore_eos": True,
                                     "top_k": 5}, return_logprob=True, logprob_start_len=0).json()
    seq = PROMPT + out["output_ids"]
    with engine.lock:
        logits = engine.model.forward(torch.tensor([seq]), torch.tensor([3]), torch.arange(len(seq))[None],
                                      all_logits=True)[0]
    logp = torch.log_softmax(logits / t, dim=-1)
    n = len(PROMPT)
    want = [float(logp[n - 1 + i, tok]) for i, tok in enumerate(out["output_ids"])]
    got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-5)
    inputs = out["meta_info"]["input_token_logprobs"]  # logprob_start_len 0: every prompt token, first None
    assert [x[1] for x in inputs] == PROMPT and inputs[0][0] is None
    raw = torch.log_softmax(logits, dim=-1)
    assert [x[0] for x in inputs[1:]] == pytest.approx([float(raw[i, PROMPT[i + 1]]) for i in range(n - 1)],
                                                        abs=1e-5)
    assert max(abs(float(raw[i, PROMPT[i + 1]] - logp[i, PROMPT[i + 1]])) for i in range(n - 1)) > 1e-2


def _background(http_base: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def call():
        result["response"] = httpx.post(f"{http_base}/generate", json=body, timeout=60).json()

    thread = threading.Thread(target=call)
    thread.start()
    return thread, result


def _wait_pending(engine, n: int = 1) -> None:
    deadline = time.monotonic() + 20
    while engine.scheduler.num_pending() < n:
        assert time.monotonic() < deadline, "request never became pending"
        time.sleep(0.01)


def test_pause_in_place_flush_continue(server, http):
    """As SGLang's flush_cache (is_fully_idle(ignore_waiting=paused)): a paused engine flushes unless a request
    holds its cache (in_place keeps a running request's); a request that arrived during the pause only waits."""
    base, engine = server
    assert http.post("/flush_cache").status_code == 200
    assert http.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    thread, result = _background(base, {"input_ids": PROMPT, "sampling_params": {"temperature": 0,
                                                                                 "max_new_tokens": 4}})
    _wait_pending(engine)
    time.sleep(0.2)
    assert engine.scheduler.num_pending() == 1  # paused: it waits
    assert http.post("/flush_cache").status_code == 200  # waiting, no cache yet
    assert http.post("/continue_generation").json()["success"]
    thread.join(timeout=60)
    assert result["response"]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    with slow_steps(engine):  # now one paused mid-generation, its cache kept in place
        thread, result = _background(base, {"input_ids": PROMPT, "sampling_params": {
            "temperature": 0, "max_new_tokens": 100, "ignore_eos": True}})
        _wait_pending(engine)
        while not any(r.output_ids for r in engine.scheduler.running()):
            time.sleep(0.005)
        assert http.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
        assert http.post("/flush_cache").status_code == 400  # requests hold their cache: trainers retry
        assert http.post("/continue_generation").json()["success"]
    thread.join(timeout=60)
    assert result["response"]["meta_info"]["completion_tokens"] == 100
    assert http.post("/flush_cache").status_code == 200


@contextlib.contextmanager
def slow_steps(engine, seconds: float = 0.02):
    """Every model forward takes ``seconds`` longer, so that a 100-token request is still running when the
    test's next HTTP call arrives, however fast the engine and however loaded the machine."""
    forward = engine.model.forward

    def slow(*args, **kw):
        time.sleep(seconds)
        return forward(*args, **kw)

    engine.model.forward = slow
    try:
        yield
    finally:
        engine.model.forward = forward


def test_pause_abort_returns_partial_requests(server, http):
    base, engine = server
    with slow_steps(engine):
        thread, result = _background(base, {"input_ids": PROMPT, "sampling_params": {
            "temperature": 0, "max_new_tokens": 100, "ignore_eos": True}})
        _wait_pending(engine)
        while not any(r.output_ids for r in engine.scheduler.running()):
            time.sleep(0.005)
        paused = http.post("/pause_generation", json={"mode": "abort"}).json()
        thread.join(timeout=60)
    assert paused["num_paused_requests"] == 1
    meta = result["response"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 100  # partial output kept
    assert http.post("/continue_generation").status_code == 200
    assert gen(http, sampling_params={"max_new_tokens": 2}).status_code == 200


def test_pause_retract_resumes_identically(server, http):
    """retract drops the KV cache; on continue the request is re-prefilled and ends as if never paused."""
    base, engine = server
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 100, "ignore_eos": True}}
    straight = http.post("/generate", json=body).json()["output_ids"]
    with slow_steps(engine):
        thread, result = _background(base, body)
        _wait_pending(engine)
        while not any(r.output_ids for r in engine.scheduler.running()):
            time.sleep(0.005)
        paused = http.post("/pause_generation", json={"mode": "retract"}).json()
    assert paused["num_paused_requests"] == 1
    time.sleep(0.1)
    assert engine.scheduler.num_pending() == 1 and thread.is_alive()
    # SGLang flushes a paused engine whose requests wait without a cache (is_fully_idle(ignore_waiting=paused)):
    # the sync of the bounded-staleness pipeline runs exactly this while requests are in flight
    assert http.post("/flush_cache").status_code == 200
    http.post("/continue_generation")
    thread.join(timeout=60)
    assert result["response"]["output_ids"] == straight


def test_update_weights_from_disk(server, http, model_dir, tmp_path):
    r = http.post("/update_weights_from_disk", json={"model_path": model_dir, "weight_version": "disk-1"})
    assert r.status_code == 200 and r.json()["success"] and r.json()["num_paused_requests"] == 0
    assert gen(http, sampling_params={"max_new_tokens": 1}).json()["meta_info"]["weight_version"] == "disk-1"
    from megatron_qarl.qat.export import quantize_checkpoint

    other = quantize_checkpoint(model_dir, "w4a16", tmp_path / "w4")  # another format: refused, nothing loaded
    r = http.post("/update_weights_from_disk", json={"model_path": str(other), "weight_version": "bad"})
    assert r.status_code == 400 and not r.json()["success"] and "not a tensor" in r.json()["message"]
    assert http.get("/get_model_info").json()["weight_version"] == "disk-1"


def test_text_input(http):
    out = http.post("/generate", json={"text": "Q: 5+5= A:", "sampling_params": {"temperature": 0,
                                                                                  "max_new_tokens": 3}})
    assert out.status_code == 200 and isinstance(out.json()["text"], str)


@pytest.mark.parametrize("body,status", [
    ({"input_ids": [2, 999]}, 400),  # out of vocabulary
    ({"input_ids": [2, -1]}, 400),
    ({"input_ids": [2, 5], "sampling_params": {"max_new_tokens": 10_000}}, 400),  # beyond the context
    ({"input_ids": [2, 5], "sampling_params": {"max_new_tokens": 2**62}}, 400),
    ({"input_ids": [2, 5], "sampling_params": {"max_new_tokens": 10**40}}, 400),  # beyond any machine integer
    ({"input_ids": [2, 5], "sampling_params": {"max_new_tokens": -1}}, 422),
    ({"input_ids": [2, 5], "sampling_params": {"max_new_tokens": 1.5}}, 422),
    ({"input_ids": [2, 2**70]}, 400),
    ({"input_ids": [[2, 5], [2, 32]]}, 400),  # one bad prompt in a batch: the whole batch is refused
    ({"input_ids": [2, 5.5]}, 422),
    ({"input_ids": list(range(2, 30)) * 10}, 400),  # a prompt longer than the context
    ({"input_ids": [2], "sampling_params": {"top_p": 0}}, 422),
    ({"input_ids": [2], "sampling_params": {"sampling_seed": 2**64}}, 422),
    ({"input_ids": []}, 400),
    ({"input_ids": [[]]}, 400),
    ({"input_ids": [2], "text": "Q"}, 400),
    ({}, 400),
    ({"input_ids": [2], "sampling_params": {"temperature": -1}}, 422),
    ({"input_ids": [2], "sampling_params": {"stop_token_ids": [77]}}, 400),
    ({"input_ids": [2], "sampling_params": {"unknown_knob": 1}}, 422),
    ({"input_ids": [[2], [3]], "sampling_params": [{}]}, 400),
    ({"input_ids": "abc"}, 422),
])
def test_bad_input_is_4xx(http, body, status):
    r = http.post("/generate", json=body)
    assert r.status_code == status, r.text
    assert r.text  # with a message


@pytest.mark.parametrize("path", ["/generate", "/update_weights_from_disk", "/init_weights_update_group",
                                  "/update_weights_from_distributed", "/pause_generation"])
@pytest.mark.parametrize("content", [b"{not json", b'{"input_ids": [2, 5]', b"\xff\xfe\x00", b"[1, 2]", b"42", b"null"])
def test_malformed_json_is_4xx(http, path, content):
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    if path == "/pause_generation":
        http.post("/continue_generation")  # in case it paused: the module's server is shared
        if content == b"null":  # the body is optional there: JSON null is no body, a plain pause
            assert r.status_code == 200, r.text
            return
    assert 400 <= r.status_code < 500 and r.text, (path, content, r.status_code, r.text)
    if content.startswith(b"{"):
        assert r.status_code == 422 and "json" in r.text.lower()


def test_loopback_detection():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ServerConfig(host=host).loopback, host
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.168.1.7", "example.com", "my-host"):
        assert not ServerConfig(host=host).loopback, host


def test_non_loopback_needs_api_key(server):
    from fastapi.testclient import TestClient

    _, engine = server
    with pytest.raises(UserError, match="api-key"):
        build_app(engine, ServerConfig(host="0.0.0.0"))
    client = TestClient(build_app(engine, ServerConfig(host="0.0.0.0", api_key="s3cret")))
    assert client.get("/health").status_code == 200
    for method, path, body in [("post", "/update_weights_from_disk", {"model_path": "/x"}),
                               ("post", "/init_weights_update_group", {}), ("post", "/flush_cache", None),
                               ("post", "/pause_generation", None), ("post", "/continue_generation", None),
                               ("post", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
                               ("post", "/destroy_weights_update_group", {}), ("post", "/weights_checker", {}),
                               ("post", "/begin_weight_update", {}), ("post", "/end_weight_update", {}),
                               ("get", "/get_model_info", None), ("post", "/generate", {"input_ids": [2]})]:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = client.request(method.upper(), path, json=body, headers=headers)
            assert r.status_code == 401, path
    ok = {"Authorization": "Bearer s3cret"}
    assert client.post("/flush_cache", headers=ok).status_code == 200
    assert client.post("/generate", json={"input_ids": [2], "sampling_params": {"max_new_tokens": 1}},
                       headers=ok).status_code == 200


def test_openapi_fuzz_never_500(model_dir, monkeypatch):
    """schemathesis over the OpenAPI schema, every operation, in process (ASGI): no input gets a 5xx, and no
    request that reaches the engine makes it fail (an engine exception would surface as an abort, not a 500).

    Two stand-ins keep it bounded: the rendezvous of /init_weights_update_group fails at once (a fuzzed
    master address would otherwise wait for a peer until the timeout), and generation is resumed after
    every /pause_generation case (a paused engine holds /generate until /continue_generation)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    from megatron_qarl import wire

    def no_peer(*_args, **_kw):
        raise RuntimeError("rendezvous refused (fuzz stand-in)")

    monkeypatch.setattr(wire, "init_custom_process_group", no_peer)
    engine = Engine(EngineConfig(model_path=model_dir, dtype="bfloat16", max_batch_size=4, max_seq_len=24))
    app = build_app(engine, ServerConfig())
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    calls: dict[str, dict[int, int]] = {}
    try:
        ops = [op.ok() for op in schema.get_all_operations()]
        paths = {op.path for op in ops}
        assert {"/generate", "/update_weights_from_distributed", "/init_weights_update_group",
                "/pause_generation", "/update_weights_from_disk"} <= paths, paths
        for op, mode in itertools.product(ops, GenerationMode):  # valid bodies, then schema-violating ones
            # derandomize: the same cases on every run (CI once drew only 3 valid /generate bodies of 100)
            @settings(max_examples=100 if op.path == "/generate" else 20, deadline=None, database=None,
                      derandomize=True, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call()
                if case.path == "/pause_generation":
                    engine.resume()
                codes = calls.setdefault(f"{case.method} {case.path}", {})
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                assert response.status_code < 500, (case.path, case.body, response.text)
                if case.path == "/generate" and response.status_code == 200:
                    outs = response.json()
                    for out in outs if isinstance(outs, list) else [outs]:
                        reason = out["meta_info"]["finish_reason"]
                        assert "engine error" not in str(reason.get("message", "")), (case.body, reason)

            try:
                check()
            except Unsatisfiable:  # nothing to violate: no body, no parameters (GET /health and the like)
                assert mode is GenerationMode.NEGATIVE and not op.body, op.path
        print(f"\nstatus codes per operation: {calls}")
        gen = calls["POST /generate"]
        assert sum(gen.values()) >= 150 and gen.get(422, 0) >= 20  # schema-violating bodies were sent
        assert gen.get(200, 0) >= 5  # and valid requests were generated and served
    finally:
        engine.shutdown()


def _serve_parser():
    import argparse

    from megatron_qarl.serve import cli as serve_cli

    parser = argparse.ArgumentParser(prog="qarl")
    serve_cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_cli_refuses_open_host_without_key(model_dir):
    args = _serve_parser().parse_args(["serve", "--model", model_dir, "--host", "0.0.0.0"])
    with pytest.raises(UserError, match="api-key"):
        args.func(args)
    args = _serve_parser().parse_args(["serve", "--model", "/nonexistent"])
    with pytest.raises(UserError, match="/nonexistent: not a directory"):
        args.func(args)


def test_cli_serves_over_http(model_dir):
    """`qarl serve` end to end: a subprocess on a free port answers /health and /generate."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "megatron_qarl.cli", "serve", "--model", model_dir, "--port",
                             str(port), "--dtype", "float32", "--num-threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "qarl serve did not come up"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [[2, 5], [2, 6, 7]],
                       "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}, timeout=30)
        assert r.status_code == 200 and [o["meta_info"]["completion_tokens"] for o in r.json()] == [3, 3]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
