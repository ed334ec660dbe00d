"""The rollout client (retries, bounded concurrency, errors) and the SGLang launch command lines."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_qarl.rollout.client import ClientConfig, RolloutServerError, SGLangClient
from megatron_qarl.rollout.sglang_launcher import SGLangServerSpec, checkpoint_scheme, launch_command


def _client(handler, **cfg) -> SGLangClient:
    return SGLangClient("http://server:30000", api_key="k", transport=httpx.MockTransport(handler),
                        config=ClientConfig(backoff_s=0.0, **cfg))


def test_generate_sends_sglang_fields_and_retries_5xx():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        assert request.headers["authorization"] == "Bearer k"
        if len(calls) < 3:
            return httpx.Response(503, text="warming up")
        return httpx.Response(200, json={"text": "x", "meta_info": {"finish_reason": {"type": "stop"}}})

    async def run():
        async with _client(handler, retries=3) as c:
            return await c.generate([1, 2, 3], {"temperature": 1.0, "max_new_tokens": 4})

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(calls) == 3
    assert calls[0] == {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 1.0, "max_new_tokens": 4},
                        "return_logprob": True, "logprob_start_len": -1}


def test_4xx_raises_at_once_with_the_servers_message():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(400, json={"error": "input_ids: token 99 out of vocabulary"})

    async def run():
        async with _client(handler) as c:
            await c.generate([99], {})

    with pytest.raises(RolloutServerError, match="http://server:30000/generate: HTTP 400: .*out of vocabulary") as e:
        asyncio.run(run())
    assert e.value.status == 400 and len(calls) == 1


def test_retries_run_out_on_a_dead_server():
    def handler(request):
        raise httpx.ConnectError("connection refused")

    async def run():
        async with _client(handler, retries=2) as c:
            await c.generate([1], {})

    with pytest.raises(RolloutServerError, match="generate: ConnectError"):
        asyncio.run(run())


def test_concurrency_is_bounded():
    in_flight = peak = 0

    async def handler(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, json={"text": ""})

    async def run():
        async with _client(handler, max_concurrency=3) as c:
            await asyncio.gather(*(c.generate([1], {}) for _ in range(12)))

    asyncio.run(run())
    assert peak == 3


def _ckpt(tmp_path, qcfg=None):
    cfg = {"model_type": "qwen3_moe"}
    if qcfg:
        cfg["quantization_config"] = qcfg
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("qcfg, scheme", [
    (None, "bf16"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "w4a16"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "w8a8_fp8"),
    ({"quant_method": "w8a8_int8"}, "w8a8_int8"),
])
def test_launch_command_per_scheme(qcfg, scheme, tmp_path):
    path = _ckpt(tmp_path, qcfg)
    assert checkpoint_scheme(path) == scheme
    cmd = launch_command(SGLangServerSpec(model_path=path, port=31000, tp=4, ep=4, host="0.0.0.0",
                                          api_key_file="/run/k.yaml"), python="python")
    runner = ["--moe-runner-backend", "marlin"] if scheme == "w4a16" else []  # Triton's W4A16 breaks updates
    assert cmd == ["python", "-m", "sglang.launch_server", "--model-path", path, "--host", "0.0.0.0",
                   "--port", "31000", "--tp-size", "4", "--ep-size", "4", *runner, "--config", "/run/k.yaml"]
    assert "--quantization" not in cmd  # offline-quantized: SGLang reads config.json
    seeded = launch_command(SGLangServerSpec(model_path=path, deterministic_inference=True), python="python")
    assert "--enable-deterministic-inference" in seeded  # else SGLang ignores sampling_seed


def test_launch_command_multi_node(tmp_path):
    spec = SGLangServerSpec(model_path=_ckpt(tmp_path), tp=16, ep=16, nnodes=2, node_rank=1,
                            dist_init_addr="10.0.0.1:5000", mem_fraction_static=0.7)
    cmd = launch_command(spec, python="python")
    assert cmd[cmd.index("--nnodes"):] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"


def test_launch_command_errors(tmp_path):
    with pytest.raises(ValueError, match="dist_init_addr"):
        launch_command(SGLangServerSpec(model_path=_ckpt(tmp_path), nnodes=2))
    with pytest.raises(ValueError, match="ep_size 8 cannot exceed"):
        launch_command(SGLangServerSpec(model_path=_ckpt(tmp_path), tp=4, ep=8))
    with pytest.raises(ValueError, match="dp=2: SGLang's weight updates assert dp_size == 1"):
        launch_command(SGLangServerSpec(model_path=_ckpt(tmp_path), tp=2, dp=2))
    fp8 = _ckpt(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="block-FP8 MoE needs tp % ep == 0"):
        launch_command(SGLangServerSpec(model_path=fp8, tp=6, ep=4))
    with pytest.raises(ValueError, match="quant_method 'awq' is not one of ours"):
        launch_command(SGLangServerSpec(model_path=_ckpt(tmp_path, {"quant_method": "awq"})))
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        checkpoint_scheme(tmp_path / "nothing")


def test_the_trainer_sides_http_calls_build_one_tls_context_per_process(monkeypatch):
    """httpx builds a TLS context (certifi's CA bundle, ~50 ms of CPU here) for every Client, so for every
    module-level httpx.post: the weight-update API and the client pass the one cached context instead."""
    import ssl

    from megatron_qarl.sync.weight_update import Engine, SyncError, WeightUpdateAPI
    from megatron_qarl.utils.http import tls_context

    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    tls_context.cache_clear()
    api = WeightUpdateAPI(Engine("http://127.0.0.1:9"), timeout_s=2)  # port 9 (discard): nothing listens
    for _ in range(3):
        with pytest.raises(SyncError, match="127.0.0.1:9/get_model_info"):
            api.model_info()
    with pytest.raises(SyncError, match="/health"):
        api.health()
    SGLangClient("http://127.0.0.1:9")
    assert len(built) == 1
