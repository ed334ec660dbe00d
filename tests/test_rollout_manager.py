"""G samples per prompt from several servers; a server that dies loses no prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from megatron_qarl.rollout.client import ClientConfig, RolloutServerError, SGLangClient
from megatron_qarl.rollout.manager import EveryServerDown, RolloutManager, SamplingConfig, sample_seed


def _server(name: str, die_after: int | None = None):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if die_after is not None and len(seen) >= die_after:
            raise httpx.ConnectError(f"{name} is down")
        body = json.loads(request.content)
        seen.append(body)
        seed = body["sampling_params"]["sampling_seed"]
        out = [seed % 7 + 4, 1]  # two tokens: something, then eos
        return httpx.Response(200, json={"text": "", "output_ids": out, "meta_info": {
            "finish_reason": {"type": "stop"}, "weight_version": "v3",
            "output_token_logprobs": [[-0.5, out[0], None], [-0.1, out[1], None]]}})

    client = SGLangClient(f"http://{name}", transport=httpx.MockTransport(handler),
                          config=ClientConfig(retries=1, backoff_s=0.0))
    return client, seen


def test_every_prompt_gets_g_samples_with_distinct_seeds():
    a, seen_a = _server("a")
    b, seen_b = _server("b")
    mgr = RolloutManager(SamplingConfig(n_samples=4, max_new_tokens=8), stop_token_ids=[1], seed=9)
    groups = asyncio.run(mgr.generate([a, b], [[5, 6], [7, 8, 9], [10]], step=2))
    assert [len(g) for g in groups] == [4, 4, 4]
    assert len(seen_a) + len(seen_b) == 12 and seen_a and seen_b  # both servers used
    for p, group in enumerate(groups):
        for j, s in enumerate(group):
            assert (s.prompt_index, s.sample_index) == (p, j)
            assert s.response_ids == [sample_seed(9, 2, p, j) % 7 + 4, 1] and s.logp_sampler == [-0.5, -0.1]
            assert s.weight_version == "v3" and s.finish_reason == "stop"
    params = (seen_a + seen_b)[0]["sampling_params"]
    assert params["stop_token_ids"] == [1] and params["max_new_tokens"] == 8


def test_a_server_dying_mid_rollout_loses_no_prompt():
    a, _ = _server("a")
    b, seen_b = _server("b", die_after=3)
    mgr = RolloutManager(SamplingConfig(n_samples=8), stop_token_ids=[1])
    prompts = [[i + 4] for i in range(16)]
    groups = asyncio.run(mgr.generate([a, b], prompts, step=0))
    assert sum(len(g) for g in groups) == 16 * 8
    assert {(s.prompt_index, s.sample_index) for g in groups for s in g} == {(p, j) for p in range(16)
                                                                           for j in range(8)}
    assert mgr.alive == [True, False] and mgr.server_failures == 1 and mgr.resent >= 1
    servers = [s.server for g in groups for s in g]
    assert servers.count("http://b") == len(seen_b) == 3 and servers.count("http://a") == 16 * 8 - 3


def test_every_server_down_keeps_the_finished_samples_and_a_new_call_sends_only_the_rest():
    a, seen_a = _server("a", die_after=3)
    mgr = RolloutManager(SamplingConfig(n_samples=4), stop_token_ids=[1])
    prompts = [[4], [5]]
    with pytest.raises(EveryServerDown, match="every server is down"):
        asyncio.run(mgr.generate([a], prompts, step=0))
    assert len(mgr.finished) == len(seen_a) == 3 and mgr.server_failures == 1 and mgr.resent == 5
    restarted, seen = _server("a2")  # what the trainer does next: restart, sync, then call again
    groups = asyncio.run(mgr.generate([restarted], prompts, step=0))
    assert len(seen) == 8 - 3 and [len(g) for g in groups] == [4, 4]
    assert {(s.prompt_index, s.sample_index) for g in groups for s in g} == {(p, j) for p in range(2) for j in range(4)}
    assert [s.response_ids for g in groups for s in g] == [[sample_seed(0, 0, p, j) % 7 + 4, 1] for p in range(2)
                                                           for j in range(4)]


def test_a_rejected_request_is_an_error_not_a_dead_server():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "bad request"})

    client = SGLangClient("http://a", transport=httpx.MockTransport(handler), config=ClientConfig(retries=1))
    mgr = RolloutManager(SamplingConfig(n_samples=1), stop_token_ids=[1])
    with pytest.raises(RolloutServerError) as err:
        asyncio.run(mgr.generate([client], [[4]], step=0))
    assert not isinstance(err.value, EveryServerDown) and mgr.alive == [True] and mgr.server_failures == 0


def _routed_server(routes_for):
    """A server answering two tokens; ``routes_for(body, seqlen)`` gives meta_info.routed_experts (or None)."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        out = [4, 1]
        meta = {"finish_reason": {"type": "stop"}, "weight_version": "v1",
                "output_token_logprobs": [[-0.5, out[0], None], [-0.1, out[1], None]]}
        routed = routes_for(body, len(body["input_ids"]) + len(out))
        if routed is not None:
            meta["routed_experts"] = routed
        return httpx.Response(200, json={"text": "", "output_ids": out, "meta_info": meta})

    return SGLangClient("http://r", transport=httpx.MockTransport(handler), config=ClientConfig(retries=0))


def _b64(t: torch.Tensor) -> str:
    import base64

    return base64.b64encode(t.numpy().tobytes()).decode()


@pytest.mark.parametrize(("routes_for", "message"), [
    (lambda body, n: None, r"http://r: prompt 0 sample 0: no meta_info.routed_experts .*--enable-return-routed"),
    (lambda body, n: _b64(torch.zeros(n, 2, 2, dtype=torch.int32)),
     r"routed_experts has \d+ bytes; expected int32 \[2, 2, 2\]"),
    (lambda body, n: _b64(torch.full((n - 1, 2, 2), 9, dtype=torch.int32)),
     r"expert ids \[9, 9\] outside \[0, 8\)"),
])
def test_bad_or_missing_routes_fail_naming_the_sample(routes_for, message):
    from megatron_qarl.rollout.manager import RoutesSpec

    mgr = RolloutManager(SamplingConfig(n_samples=1), stop_token_ids=[1],
                         routes=RoutesSpec(layers=2, topk=2, num_experts=8))
    with pytest.raises(RolloutServerError, match=message):
        asyncio.run(mgr.generate([_routed_server(routes_for)], [[5]], step=0))
    assert mgr.resent == 0  # a contract error is not re-sent to another server


def test_routes_are_asked_for_and_decoded():
    from megatron_qarl.rollout.manager import RoutesSpec

    seen = []

    def routes_for(body, n):
        seen.append(body)
        return _b64(torch.arange(4, dtype=torch.int32).repeat(n - 1, 1).view(n - 1, 2, 2))

    mgr = RolloutManager(SamplingConfig(n_samples=1), stop_token_ids=[1],
                         routes=RoutesSpec(layers=2, topk=2, num_experts=8))
    (group,) = asyncio.run(mgr.generate([_routed_server(routes_for)], [[5, 6]], step=0))
    assert seen[0]["return_routed_experts"] is True
    assert group[0].routes.shape == (3, 2, 2) and group[0].routes[2].tolist() == [[0, 1], [2, 3]]


def _scripted_server(answers: list):
    """A server answering /generate with ``answers`` in turn: each (finish type, output ids, version, with routes);
    routes row r of a forwarded position p is experts [p % 8, (p + 1) % 8] in every layer (2 layers, top-2), so a
    stitched sample shows which request computed each row."""
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        finish, out, version, routed = answers[min(len(seen), len(answers)) - 1]
        start = body.get("routed_experts_start_len", 0)
        seqlen = len(body["input_ids"]) + len(out)
        meta = {"finish_reason": {"type": finish}, "weight_version": version,
                "weight_versions": [{"version": version, "start": 0, "end": len(out)}] if out else [],
                "output_token_logprobs": [[-0.1 * (t + 1), t, None] for t in out]}
        if routed and body.get("return_routed_experts"):
            pos = torch.arange(start, seqlen - 1, dtype=torch.int32)
            rows = torch.stack([pos % 8, (pos + 1) % 8], -1)[:, None].expand(-1, 2, 2).contiguous()
            meta["routed_experts"] = _b64(rows)
        return httpx.Response(200, json={"text": "", "output_ids": out, "meta_info": meta})

    return SGLangClient("http://s", transport=httpx.MockTransport(handler), config=ClientConfig(retries=0)), seen


def test_an_aborted_request_is_continued_and_its_segments_stitched_with_their_routes():
    """A sync that aborts a running request (SGLang's pause_generation abort, R3 in bounded mode): the manager keeps
    the partial output and its routes, sends prompt + output as a new request for the rest (budget reduced, its
    own seed, routes of the new positions only: routed_experts_start_len = its prompt length - 1), and stitches
    tokens, log-probs, per-token versions and routes into one sample. An answer aborted while queued (no routes)
    keeps nothing."""
    from megatron_qarl.rollout.manager import RoutesSpec

    client, seen = _scripted_server([("abort", [5, 6, 7], "v1", True), ("abort", [9], "v2", False),
                                     ("stop", [8, 1], "v2", True)])
    mgr = RolloutManager(SamplingConfig(n_samples=1, max_new_tokens=10), stop_token_ids=[1], seed=3,
                         routes=RoutesSpec(layers=2, topk=2, num_experts=8), max_idle_aborts=2)
    ((s,),) = asyncio.run(mgr.generate([client], [[2, 3]], step=4))
    assert [b["input_ids"] for b in seen] == [[2, 3], [2, 3, 5, 6, 7], [2, 3, 5, 6, 7]]
    assert [b["sampling_params"]["max_new_tokens"] for b in seen] == [10, 7, 7]
    assert "routed_experts_start_len" not in seen[0] and [b["routed_experts_start_len"] for b in seen[1:]] == [4, 4]
    seeds = [b["sampling_params"]["sampling_seed"] for b in seen]
    assert seeds[0] == sample_seed(3, 4, 0, 0) and len(set(seeds)) == 3
    assert s.prompt_ids == [2, 3] and s.response_ids == [5, 6, 7, 8, 1] and s.finish_reason == "stop"
    assert s.logp_sampler == pytest.approx([-0.6, -0.7, -0.8, -0.9, -0.2])
    assert s.versions() == ["v1"] * 3 + ["v2"] * 2 and mgr.continued == 2
    # rows 0..5: positions 0..5 of [2, 3, 5, 6, 7, 8, 1], each from the request that forwarded it
    assert s.routes.shape == (6, 2, 2) and s.routes[:, 0, 0].tolist() == list(range(6))


@pytest.mark.parametrize(("answers", "finish", "response"), [
    ([("abort", [5, 1], "v1", True)], "stop", [5, 1]),  # SGLang checks the abort before the stop token it sampled
    ([("abort", [5, 6, 7, 8], "v1", True)], "length", [5, 6, 7, 8]),
])
def test_an_aborted_request_that_already_ended_is_not_continued(answers, finish, response):
    from megatron_qarl.rollout.manager import RoutesSpec

    client, seen = _scripted_server(answers)
    mgr = RolloutManager(SamplingConfig(n_samples=1, max_new_tokens=4), stop_token_ids=[1],
                         routes=RoutesSpec(layers=2, topk=2, num_experts=8), max_idle_aborts=2)
    ((s,),) = asyncio.run(mgr.generate([client], [[2, 3]], step=0))
    assert len(seen) == 1 and s.finish_reason == finish and s.response_ids == response


def test_aborts_without_output_beyond_the_limit_are_a_failing_server_and_without_continuation_an_answer():
    a, seen_a = _scripted_server([("abort", [], "v1", False)])
    b, seen_b = _scripted_server([("stop", [4, 1], "v2", False)])
    mgr = RolloutManager(SamplingConfig(n_samples=1), stop_token_ids=[1], max_idle_aborts=2)
    with pytest.raises(EveryServerDown):
        asyncio.run(mgr.generate([a], [[2]], step=0))
    assert len(seen_a) == 3 and mgr.server_failures == 1 and mgr.resent == 1
    ((s,),) = asyncio.run(mgr.generate([b], [[2]], step=0))  # the restarted server
    assert s.response_ids == [4, 1] and len(seen_b) == 1
    a, _ = _scripted_server([("abort", [5], "v1", False)])
    ((s,),) = asyncio.run(RolloutManager(SamplingConfig(n_samples=1), stop_token_ids=[1]).generate([a], [[2]], 0))
    assert s.finish_reason == "abort" and s.response_ids == [5]  # max_idle_aborts None: an abort is an answer
