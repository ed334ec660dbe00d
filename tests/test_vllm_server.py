"""A real vLLM 0.32 server (its own environment, started by the product's launcher, rollout.backend=vllm) in the
loop: the rollout manager's requests in vLLM's API, the learner's weight sync through vLLM's weight-transfer API
and our ``qarl`` backend (gloo on CPU), and the prepack vLLM 0.32 skips on a reload.

One float32 server for the module, with an API key (start-up dominates: about 40 s on an idle 2-core machine with
--enforce-eager), the tiny BF16 checkpoint, a float32 learner (bf16 scheme: the learner's forward is the served
weights'):
- every route but /health asks for the key, the dev routes (/collective_rpc: any worker method) too, which vLLM's
  own --api-key leaves open (rollout/vllm_ext/qarl_vllm_auth.py);
- sampled log-probs equal the learner's within 1e-5 per token; a prefill score (the trainer's rescore, vLLM's
  prompt_logprobs) equals the learner's unscaled log-probs at any temperature (SGLang's input_token_logprobs
  semantics); with top_p < 1 vLLM's log-probs are of the filtered distribution, not the learner's (why the config
  refuses top_p / top_k with vLLM);
- an unchanged full sync leaves vLLM's sampled tokens and log-probs bit-identical and its own weight checksums
  (/weight_checker) unchanged (fails without ``reprepack_reloaded_experts``: the reloaded experts are unpacked);
- after a training step, a sync moves vLLM's log-probs to the learner's new ones (within 1e-5), and
  /weight_info names the synced version;
- a vLLM server killed (SIGKILL) mid-rollout loses no prompt: its requests go to the other server (an embedded one
  here), and stopping it ends the engine processes it left behind.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import torch
from vllm_tools import VLLM_PYTHON, needs_vllm

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.launch.local import LocalServers
from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import init_parallel, run_ranks
from megatron_qarl.preflight.rules import load_config
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.rollout.manager import RolloutManager, SamplingConfig
from megatron_qarl.rollout.vllm_client import VLLMClient
from megatron_qarl.sync.broadcaster import DistributedBroadcaster, Engine
from megatron_qarl.sync.vllm_weight_update import VLLMWeightUpdateAPI

pytestmark = [pytest.mark.e2e]
PROMPTS = [[3, 9, 4, 12, 8], [5, 5, 20, 1], [17, 2, 6, 11, 14, 7], [8, 19, 3]]
KEY = "qarl-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, private_tiny_copy):
    if not __import__("pathlib").Path(VLLM_PYTHON).is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run scripts/make_vllm_env.sh (CI does)")
    root = tmp_path_factory.mktemp("vllm_server")
    (root / "model").mkdir()
    model_dir = private_tiny_copy(root / "model")
    cfg = load_config("configs/cpu_bf16_rollout.yaml", [
        "rollout.backend=vllm", f"rollout.server_python={VLLM_PYTHON}", "rollout.dtype=float32",
        f"rollout.api_key={KEY}",
        f"train.output_dir={root / 'run'}", "rollout.startup_timeout_s=900", "launch.backend=local"])
    servers = LocalServers(cfg, model_dir)
    yield model_dir, servers
    servers.close()


def _rollout(url: str, step: int, top_p: float = 1.0) -> list:
    manager = RolloutManager(SamplingConfig(n_samples=2, temperature=1.0, top_p=top_p, max_new_tokens=12), [0],
                             seed=5)

    async def go():
        async with VLLMClient(url, api_key=KEY) as client:
            return await manager.generate([client], PROMPTS, step)

    return [s for group in asyncio.run(go()) for s in group]


def _rescored(url: str, samples: list, temperature: float) -> list[torch.Tensor]:
    """The trainer's rescore request (train/rollouts.py) of each sample's response: input_token_logprobs."""
    params = {"temperature": temperature, "max_new_tokens": 1, "stop_token_ids": []}

    async def go():
        async with VLLMClient(url, api_key=KEY) as client:
            return await asyncio.gather(*(client.generate(s.prompt_ids + s.response_ids, params,
                                                          logprob_start_len=len(s.prompt_ids)) for s in samples))

    return [torch.tensor([t[0] for t in a["meta_info"]["input_token_logprobs"]][: len(s.response_ids)])
            for a, s in zip(asyncio.run(go()), samples, strict=True)]


def _learner_logp(learner: Learner, samples: list) -> list[torch.Tensor]:
    out = []
    for s in samples:
        tokens = torch.tensor([s.prompt_ids + s.response_ids])
        out.append(learner.forward_logprobs(tokens)[0, len(s.prompt_ids) - 1:])
    return out


def _mismatch(learner: Learner, samples: list) -> tuple[float, float]:
    diffs = torch.cat([(lp - torch.tensor(s.logp_sampler)).abs()
                       for lp, s in zip(_learner_logp(learner, samples), samples, strict=True)])
    return diffs.max().item(), diffs.mean().item()


def _sync_story(model_dir: str, url: str) -> dict:
    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(seed=11)
    learner = Learner(arch, ParallelConfig(), OptimConfig(lr=3e-3), quant=QuantConfig(scheme="bf16"))
    learner.load_hf(model_dir)
    out = {}
    before = _rollout(url, 0)
    out["start"] = _mismatch(learner, before)
    checker = VLLMWeightUpdateAPI(Engine(url, api_key=KEY))
    sums_before = checker.checksums()
    sync = DistributedBroadcaster([Engine(url, api_key=KEY)], dtype=torch.float32, api_cls=VLLMWeightUpdateAPI,
                                  bucket_bytes=1 << 20)
    out["report_unchanged"] = sync.sync(learner)
    again = _rollout(url, 0)
    out["unchanged_identical"] = all(a.response_ids == b.response_ids and a.logp_sampler == b.logp_sampler
                                     for a, b in zip(before, again, strict=True))
    out["checksums_unchanged"] = checker.call("POST", "/weight_checker",
                                              {"action": "compare", "baseline": sums_before})
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, arch.vocab_size, (4, 24), generator=gen)
    mask = torch.ones(4, 23)
    learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
    out["stale"] = _mismatch(learner, again)
    out["report_changed"] = sync.sync(learner)
    after = _rollout(url, 0)
    out["changed"] = _mismatch(learner, after)
    out["version"] = httpx.get(url + "/weight_info", headers=AUTH, timeout=30).json()["weight_version"]
    learner_lp = _learner_logp(learner, after)  # temperature 1: the unscaled log-probs
    out["rescore"] = {t: max(float((a - b).abs().max()) for a, b in zip(_rescored(url, after, t), learner_lp,
                                                                        strict=True)) for t in (1.0, 0.5)}
    out["top_p"] = _mismatch(learner, _rollout(url, 1, top_p=0.5))
    sync.close()
    return out


@needs_vllm
def test_vllm_rollouts_and_syncs_agree_with_the_learner_and_an_unchanged_sync_changes_nothing(vllm_server):
    model_dir, servers = vllm_server
    url = servers.urls[0]
    out = run_ranks(1, _sync_story, model_dir, url)[0]
    r1, r2 = out["report_unchanged"], out["report_changed"]
    print(f"\nfloat32 vLLM vs float32 learner, max/mean |dlogp|: start {out['start'][0]:.2e}/{out['start'][1]:.2e}; "
          f"after a step, before its sync {out['stale'][0]:.2e}; after the sync {out['changed'][0]:.2e}/"
          f"{out['changed'][1]:.2e}; syncs: {r1.tensors} tensors, {r1.bytes} B in {r1.seconds:.2f} s and "
          f"{r2.seconds:.2f} s; weight_checker after the unchanged sync: {out['checksums_unchanged']}")
    assert out["start"][0] <= 1e-5
    assert out["unchanged_identical"], "an unchanged full sync changed vLLM's samples or log-probs"
    assert out["checksums_unchanged"] == {"match": True, "mismatches": []}
    assert out["stale"][0] > 1e-3  # the step moved the learner away from the served weights
    assert out["changed"][0] <= 1e-5
    assert out["version"] == "v2"
    print(f"prefill scores vs the learner (max |dlogp|) at T=1 and 0.5: {out['rescore']}; top_p 0.5 samples: "
          f"max/mean {out['top_p'][0]:.2e}/{out['top_p'][1]:.2e}")
    assert max(out["rescore"].values()) <= 1e-5  # unscaled at any temperature, as SGLang's input_token_logprobs
    assert out["top_p"][0] > 1e-2  # the filtered distribution's log-probs: what preflight/rules.py refuses


@needs_vllm
def test_with_an_api_key_every_route_but_health_asks_for_it(vllm_server):
    """vLLM's --api-key guards /v1 only; dev mode's /collective_rpc (any worker method), /pause, /weight_info, ...
    ask for the key here (main before issue 29 answered /collective_rpc to anyone), and so does an OPTIONS request
    that is no CORS preflight (before issue 38 every OPTIONS passed: OPTIONS /metrics returned the metrics). The
    probe body names no method, so a request that gets through is refused by the route itself (400), never run."""
    url = vllm_server[1].urls[0]
    routes = [("POST", "/collective_rpc", {}), ("GET", "/weight_info", None), ("POST", "/v1/completions", {}),
              ("POST", "/reset_prefix_cache", None), ("GET", "/metrics", None), ("OPTIONS", "/metrics", None),
              ("OPTIONS", "/collective_rpc", None)]
    without = {(m, path): httpx.request(m, url + path, json=body, timeout=60).status_code for m, path, body in routes}
    wrong = {(m, path): httpx.request(m, url + path, json=body, timeout=60, headers={"Authorization": "Bearer nope"})
             .status_code for m, path, body in routes}
    with_key = httpx.post(url + "/collective_rpc", json={}, headers=AUTH, timeout=60)
    print(f"\nwithout the key: {without}; a wrong key: {wrong}; /collective_rpc with it: {with_key.status_code}")
    assert set(without.values()) == {401} and set(wrong.values()) == {401}
    assert with_key.status_code == 400 and "method" in with_key.text
    # a CORS preflight passes the middleware and vLLM's CORSMiddleware answers it itself, never the route: vLLM 0.32
    # allows no origin by default (--allowed-origins []), so it refuses this one
    preflight = httpx.options(url + "/metrics", timeout=60, headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "GET"})
    assert (preflight.status_code, preflight.text) == (400, "Disallowed CORS origin"), preflight.text[:200]
    assert httpx.get(url + "/health", timeout=60).status_code == 200


def _quantized_servers(runs: list[tuple], root) -> dict[str, LocalServers]:
    """One vLLM server per quantized scheme among ``runs`` (AMX CPUs only: elsewhere ``unrunnable_here`` left them
    out), started as a run of that scheme would start its own (the combination runs' base config and overrides,
    serving the run's export, ``rollout_model_dir``), all spawned before any is waited for."""
    import combination_space as cs
    from combination_runs import BASE_YAML, SMALL

    from megatron_qarl.train.cli import rollout_model_dir

    schemes = sorted({dict(zip(cs.KEYS, c, strict=True))["quant.scheme"] for c in runs} - {"bf16"})
    servers: dict[str, LocalServers] = {}
    try:
        for scheme in schemes:
            cfg = load_config(str(BASE_YAML), [
                *SMALL, f"quant.scheme={scheme}", "rollout.backend=vllm", f"rollout.server_python={VLLM_PYTHON}",
                f"rollout.api_key={KEY}", f"train.output_dir={root / scheme}", "rollout.startup_timeout_s=900",
                "launch.backend=local"])
            servers[scheme] = LocalServers(cfg, rollout_model_dir(cfg), wait=False)
        for s in servers.values():
            s.wait_ready()
    except BaseException:
        for s in servers.values():
            s.close()
        raise
    return servers


@needs_vllm
def test_every_accepted_vllm_combination_runs_two_correct_steps(vllm_server, tmp_path):
    """Issue 29: the pairwise plan of the accepted rollout.backend=vllm combinations (tests/combination_space.py),
    each run two training steps against this module's float32 server (tests/combination_runs.py; launch ray: the
    learner rank as a Ray actor, the server shared). On CPUs without AMX vLLM serves bf16 only: the pairs of w4a16
    and w8a8_int8 are left to machines with AMX (tests/test_vllm_train.py runs those there too). On AMX CPUs the
    plan runs them, each quantized scheme against one shared vLLM server of its own (``_quantized_servers``), as
    bf16 does: a cluster per run took 40-100 s to start its server, and one of them left its placement group behind
    and hung the suite (issue 46)."""
    import collections
    import contextlib

    import combination_space as cs
    from combination_runs import check_runs, run_groups, unrunnable_here

    runs, left = cs.plan("vllm", cs.census("vllm"), unrunnable_here)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        shared = {"bf16": vllm_server[1].urls}
        for scheme, servers in _quantized_servers(runs, tmp_path / "quantized_servers").items():
            stack.callback(servers.close)
            shared[scheme] = servers.urls
        print(f"\nshared vLLM servers: {shared}")
        results = run_groups(runs, shared, tmp_path, ray_shared=True, extra=(f"rollout.api_key={KEY}",))
    print(f"\n{len(runs)} vLLM runs of 2 steps in {time.perf_counter() - t0:.0f} s; pairs left to other machines: "
          f"{dict(collections.Counter(left.values()))}")
    check_runs(runs, results)


@needs_vllm
def test_a_vllm_server_killed_mid_rollout_loses_no_prompt(vllm_server, tmp_path):
    """Runs last in the module (it kills the shared server). Two servers: the vLLM one and an embedded one; vLLM
    gets SIGKILL once its requests are in flight; they are re-sent to the other and every sample comes back."""
    import signal

    from megatron_qarl.moe.parallelize import free_port
    from megatron_qarl.rollout.client import SGLangClient
    from megatron_qarl.rollout.process import ServerProcess, embedded_command

    model_dir, servers = vllm_server
    url, pid = servers.urls[0], servers.pids()[0]
    port = free_port()
    other = ServerProcess(embedded_command(model_dir, port, dtype="float32"), f"http://127.0.0.1:{port}",
                          tmp_path / "embedded.log", env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=300)
    other.start()
    manager = RolloutManager(SamplingConfig(n_samples=4, temperature=1.0, max_new_tokens=40), [0], seed=5)

    async def go():
        async with VLLMClient(url, api_key=KEY) as v, SGLangClient(other.url) as e:
            real_generate, killed = v.generate, []

            async def generate_then_kill(*args, **kwargs):
                # the kill lands while vLLM's requests are in flight: the server is stopped (SIGSTOP: the kernel
                # still accepts its connections, nothing answers them) before the first is sent, and killed a
                # moment later. A timer alone fired after vLLM had answered everything (0.5 s after the start of a
                # 1.0 s rollout; in CI, 0.05 s after the first request: 32 samples in 0.4 s and no failure)
                if killed:
                    return await real_generate(*args, **kwargs)
                killed.append(True)
                os.kill(pid, signal.SIGSTOP)
                task = asyncio.ensure_future(real_generate(*args, **kwargs))
                await asyncio.sleep(0.5)
                os.kill(pid, signal.SIGKILL)
                return await task

            v.generate = generate_then_kill
            t0 = time.monotonic()
            groups = await manager.generate([v, e], PROMPTS * 2, 3)
            return groups, time.monotonic() - t0

    try:
        groups, seconds = asyncio.run(go())
    finally:
        other.stop()
    served = {s.server for g in groups for s in g}
    print(f"\nvLLM killed mid-rollout: {manager.server_failures} failure(s), {manager.resent} re-sent, "
          f"{sum(len(g) for g in groups)} samples in {seconds:.1f} s from {sorted(served)}")
    assert manager.server_failures == 1 and manager.resent > 0
    assert [len(g) for g in groups] == [4] * len(PROMPTS) * 2 and all(s.response_ids for g in groups for s in g)
    # vLLM's engine core and worker outlive a SIGKILLed API server; stopping the server ends its process group
    left = _group(pid)
    servers.close()
    deadline = time.monotonic() + 10
    while _group(pid) and time.monotonic() < deadline:  # SIGKILLed orphans linger as zombies until reaped
        time.sleep(0.2)
    print(f"live processes of the killed server's group before it was stopped: {len(left)}; after: {_group(pid)}")
    assert left and not _group(pid)


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    import psutil

    out = []
    for q in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(q.pid) == pgid and q.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(q.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out

