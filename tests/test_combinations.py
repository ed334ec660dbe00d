"""Every combination of a run's keys is refused at config load, naming the keys and the reason, or it runs
(issue 29). The space (tests/combination_space.py) comes from the config's own types: backend x train.async x
quant.scheme x R3 x delta sync x mismatch split x loss mode x mismatch correction x model.te_fp8 x model.experts x
sampling (temperature, top_p, top_k) x model.attention x launch x numerics x rollout.kv_cache_dtype, 7,464,960
combinations.

- the census (issue 52: not the product, which grows with every key): for every pair of values an accepted holder
  searched through the one loader (``preflight.rules.validate_run``), and a random sample of the product; a refusal
  names a config key first; every value of every dimension is accepted in some combination (none is dead); every
  pair an accepted combination of the sample holds, the search found.
- embedded backend (e2e): a pairwise plan of the accepted combinations (every pair of values some accepted
  combination holds is held by a run), each run two training steps (tests/combination_runs.py): local launch
  against one float32 embedded server per scheme shared by the runs, model.te_fp8 with the Transformer Engine
  stand-ins under ModelOpt's real TE plugin, launch ray through the product's RayCluster. "Runs" means correct: with
  float32 on both sides the aligned learner's per-token mismatch is <= 1e-5 wherever the sampler's weights are the
  learner's (step 1, step 2 with async off, a rollout after the last sync), and the mismatch split's quantization
  part too.
- SGLang (no GPU here): for a pairwise plan of its accepted combinations, everything up to the wire, judged by
  SGLang's own code (tests/test_sglang_contract.py's judges): the server command, the rollout, rescore and pause
  requests.
- vLLM: tests/test_vllm_server.py runs its pairwise plan against its real server.
"""

from __future__ import annotations

import asyncio
import collections
import time

import combination_space as cs
import pytest
import torch
from combination_runs import check_runs, run_groups, unrunnable_here


# ------------------------------------------------------------------------------------------------ the census
def test_the_space_is_the_product_of_the_config_types():
    from megatron_qarl.algo.policy_loss import MismatchCorrection, PolicyLossMode
    from megatron_qarl.qat.config import SCHEMES

    dims = {d.key: d.values for d in cs.DIMENSIONS}
    assert dims["quant.scheme"] == SCHEMES and dims["algo.loss.mode"] == PolicyLossMode.__args__
    assert dims["algo.loss.mismatch"] == MismatchCorrection.__args__
    assert dims["train.async"] == ("off", "one_step", "bounded") and dims["algo.routing_replay"] == (False, True)
    assert dims["numerics"] == ("default", "exact")
    assert dims["model.experts"] == ("auto", "sequential", "grouped")
    assert dims["model.attention"] == ("auto", "sdpa", "unfused")
    assert dims["rollout.kv_cache_dtype"] == ("auto", "fp8_e4m3", "fp8_e5m2")
    assert cs.SIZE == 7_464_960


def _is_key(dotted: str) -> bool:
    """A dotted key of the run config (a section or a field; train.async is async_mode's alias)."""
    from pydantic import BaseModel

    from megatron_qarl.config import QarlConfig

    node = QarlConfig
    for part in dotted.split("."):
        fields = {f.alias or name: f for name, f in node.model_fields.items()} | node.model_fields
        if part not in fields:
            return False
        annotation = fields[part].annotation
        node = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if node is None:
            return part == dotted.split(".")[-1]
    return True


@pytest.fixture(scope="module")
def census() -> dict[tuple, str | None]:
    t0 = time.perf_counter()
    out = cs.census()
    print(f"\ncensus of {len(out)} of the {cs.SIZE} combinations in {time.perf_counter() - t0:.1f} s")
    return out


def test_the_search_finds_every_pair_the_random_sample_holds(census):
    """The census validates a few thousand combinations chosen by its search; the random sample, which the search
    did not choose, checks it: no pair of values an accepted combination of the sample holds is one the search
    failed to find a holder for (measured when it was introduced: the search found the same 520 / 323 / 459 pairs
    per backend as the exhaustive census of the 276,480 combinations before model.experts)."""
    sample = [c for c in cs.sample() if census.get(c, "") is None]
    assert len(sample) > 200
    searched = [c for c in census if census[c] is None and c not in set(cs.sample())]
    missed = cs.pairs_of(sample) - cs.pairs_of(searched)
    assert not missed, sorted(missed)[:10]


def test_every_combination_is_refused_naming_its_keys_or_loads(census):
    refused = {c: m for c, m in census.items() if m is not None}
    rules = collections.Counter(cs.rule_of(m) for m in refused.values())
    print(f"\n{len(census)} combinations: {len(refused)} refused at load, {len(census) - len(refused)} accepted; "
          f"{len(rules)} rules:")
    for rule, n in rules.most_common():
        print(f"  {n:6d}  {rule}")
    unnamed = {m.split(": ", 1)[0] for m in refused.values() if not _is_key(m.split(": ", 1)[0])}
    assert not unnamed, f"refusals that do not start with a config key: {unnamed}"
    accepted = [c for c, m in census.items() if m is None]
    held = {(k, v) for c in accepted for k, v in zip(cs.KEYS, c, strict=True)}
    dead = [(d.key, v) for d in cs.DIMENSIONS for v in d.values if (d.key, v) not in held]
    assert not dead, f"values no accepted combination holds: {dead}"


# ------------------------------------------------------------------------------------------- the run plans
def test_the_pairwise_plans_hold_every_pair_that_can_run_here(census):
    for backend, why in (("embedded", unrunnable_here), ("vllm", unrunnable_here),
                         ("sglang", lambda combo: None)):  # SGLang: the wire, wherever the learner runs
        runs, left = cs.plan(backend, census, why)
        accepted = [c for c, m in census.items() if m is None and c[0] == backend]
        assert cs.pairs_of(runs) == cs.pairs_of(accepted) - set(left)
        ray = sum(dict(zip(cs.KEYS, c, strict=True))["launch.backend"] == "ray" for c in runs)
        print(f"\n{backend}: {len(accepted)} accepted combinations, {len(runs)} runs ({ray} with Ray) hold their "
              f"{len(cs.pairs_of(runs))} pairs of values; {len(left)} pairs only on other machines, because:")
        for why_not, n in collections.Counter(left.values()).most_common():
            print(f"  {n} pairs: {why_not}")


# ---------------------------------------------------------------------------------------- embedded: 2 steps
@pytest.fixture(scope="module")
def embedded_plan(census) -> list[tuple]:
    return cs.plan("embedded", census, unrunnable_here)[0]


@pytest.fixture(scope="module")
def scheme_servers(embedded_plan, tmp_path_factory):
    """One float32 embedded server per scheme, numerics and KV-cache dtype the plan's local runs use, with routes
    on, shared by them (``cs.server_key`` -> URLs)."""
    from combination_runs import BASE_YAML, KEY

    from megatron_qarl.moe.parallelize import free_port
    from megatron_qarl.preflight.rules import load_config
    from megatron_qarl.rollout.process import ServerProcess, embedded_command
    from megatron_qarl.train.cli import rollout_model_dir

    root = tmp_path_factory.mktemp("scheme_servers")
    procs = {}
    for scheme, numerics, kv in cs.shared_server_keys(embedded_plan):
        cfg = load_config(BASE_YAML, [f"quant.scheme={scheme}", f"train.output_dir={root}"])
        port, key = free_port(), cs.server_key(scheme, numerics, kv)
        procs[key] = ServerProcess(
            embedded_command(rollout_model_dir(cfg), port, dtype="float32", max_batch_size=16,
                             return_routed_experts=numerics == "default", numerics=numerics, kv_cache_dtype=kv),
            f"http://127.0.0.1:{port}", root / f"{key.replace('/', '_')}.log",
            env={"OMP_NUM_THREADS": "1", "QARL_API_KEY": KEY}, startup_timeout_s=600, secret=KEY)
        procs[key].spawn()
    try:
        for p in procs.values():
            p.wait_ready()
        yield {key: [p.url] for key, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


@pytest.mark.e2e
def test_every_accepted_embedded_combination_runs_two_correct_steps(embedded_plan, scheme_servers, tmp_path):
    """The pairwise plan of the accepted embedded combinations, two steps each against the float32 servers, every
    run's per-token agreement within combination_runs.within. W8A8 (issue 47): on an AMX / AVX-512 Xeon run06
    (w8a8_fp8, R3, delta sync, gspo, mis_seq) reached a fresh-rollout max of 0.0698. The cause is the learner's
    side: its float32 GEMMs are MKL's sgemm, and under MKL's AVX-512 kernels (the default there; SSE4_2 too) their
    order of additions puts more activations on the other side of an e4m3 rounding boundary than under its AVX2
    ones (learner AVX-512 + server AVX2: 0.0698; learner AVX2 + server AVX-512: 0.0031). The server's native fp8
    kernel, whose activation codes equal the learner's formula's on the same input, is not it. One flipped code
    moves its operand by a whole e4m3 step (up to 32/448 of the group's amax) and the later tokens through
    attention: tests/w8a8_flips.py finds the first flip of each sequence (a layer's qkv, o, gate_up or down input)
    and shows the codes explain every token; W8A8_FLIP is that model's measured bound (docs/numerics.md, "W8A8:
    activation-code flips")."""
    runs = embedded_plan
    t0 = time.perf_counter()
    results = run_groups(runs, scheme_servers, tmp_path)
    print(f"\n{len(runs)} embedded runs of 2 steps in {time.perf_counter() - t0:.0f} s")
    check_runs(runs, results)


# ----------------------------------------------------------------------------------- SGLang: up to the wire
def _sglang_requests(cfg) -> list:
    """What a run of ``cfg`` sends an SGLang server, recorded (tests/test_sglang_contract.py's Recorder answering as
    SGLang does, with routes and input log-probs when asked): the rollout manager's samples (R3: asking for the
    routed experts), the trainer's rescore for the mismatch split, the sync's pause."""
    import base64
    import json
    import types

    import httpx
    from test_sglang_contract import Recorder, _model_json

    from megatron_qarl.rollout.manager import RolloutManager, RoutesSpec
    from megatron_qarl.sync.weight_update import Engine, WeightUpdateAPI
    from megatron_qarl.train.rollouts import TrainRollouts

    model = _model_json(cfg.model.path)
    routes = RoutesSpec(model["num_hidden_layers"], model["num_experts_per_tok"], model["num_experts"]) \
        if cfg.algo.wants_routes else None

    class SGLangAnswers(Recorder):
        def __call__(self, request):
            answer = super().__call__(request)
            body = json.loads(request.content or b"{}")
            if request.url.path != "/generate":
                return answer
            data = answer.json()
            ids = body["input_ids"]
            if body.get("return_routed_experts"):
                rows = len(ids) + len(data["meta_info"]["output_token_logprobs"]) - 1
                experts = torch.arange(routes.topk, dtype=torch.int32).repeat(rows * routes.layers)
                data["meta_info"]["routed_experts"] = base64.b64encode(experts.numpy().tobytes()).decode()
            if body.get("logprob_start_len", -1) >= 0:
                data["meta_info"]["input_token_logprobs"] = [[-0.1, t, None] for t in ids[body["logprob_start_len"]:]]
            return httpx.Response(200, json=data)

    rec = SGLangAnswers("combination", model["vocab_size"])

    async def rollout():
        async with rec.client() as c:
            manager = RolloutManager(cfg.rollout.sampling, [model["eos_token_id"]], seed=cfg.seed, routes=routes)
            return await manager.generate([c], [[3, 4, 5, 6]], step=7)

    groups = asyncio.run(rollout())
    if cfg.train.async_mode != "off" and cfg.train.mismatch_split:
        rollouts = TrainRollouts(cfg, None, types.SimpleNamespace(urls=["http://sglang.test"], alive=lambda: [True]),
                                 [1], on_sync=lambda report: None)
        rollouts.client = lambda url: rec.client()
        rollouts.rescore(groups)
    http = httpx.Client(transport=httpx.MockTransport(rec))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx, "post", lambda url, *, verify, **kw: http.post(url, **kw))
        WeightUpdateAPI(Engine("http://sglang.test")).pause_generation(cfg.sync_pause_mode)
    return rec.sent


def test_every_planned_sglang_combination_is_what_sglangs_own_code_accepts(census, tmp_path):
    import sglang_stubs as stubs
    from combination_runs import BASE_YAML
    from test_sglang_contract import (
        DEFAULT,
        expected_server_args,
        serving_dir,
        sg_judge_requests,
        sg_parse_server_argv,
    )

    from megatron_qarl.launch.fleet import server_command
    from megatron_qarl.preflight.rules import load_config

    runs, _ = cs.plan("sglang", census, lambda combo: None)  # the wire does not depend on where the learner runs
    proc = stubs.SGLangProcess()
    problems, requests = [], []
    try:
        for i, combo in enumerate(runs):
            cfg = load_config(BASE_YAML, cs.as_overrides(combo))
            model_dir = serving_dir(cfg, tmp_path / f"run{i}")
            cmd = server_command(cfg, model_dir, "127.0.0.1", 30123)
            expected = expected_server_args(cfg, model_dir, "127.0.0.1", 30123, cfg.quant.scheme)
            out = proc.run(sg_parse_server_argv, cmd[3:], sorted(expected))
            if out["error"] or out["unknown"]:
                problems.append(f"{cs.describe(combo)}: SGLang's parser: {out['error']} {out['unknown']}")
                continue
            wrong = {k: (out["values"][k], v) for k, v in expected.items()
                     if v is not DEFAULT and out["values"][k] != v}
            if wrong:
                problems.append(f"{cs.describe(combo)}: SGLang parsed (got, wanted) {wrong}")
            requests += _sglang_requests(cfg)
        problems += proc.run(sg_judge_requests, requests)
    finally:
        proc.close()
    paths = collections.Counter(r.path for r in requests)
    print(f"\n{len(runs)} SGLang combinations: their server commands and {len(requests)} requests {dict(paths)} "
          "judged by SGLang's own code")
    assert not problems, "\n".join(problems[:10])
    assert {"/generate", "/pause_generation"} <= set(paths)


def test_a_stale_batch_without_a_behaviour_correction_is_refused():
    """Issue 29 item 8: token_ppo / gspo with mismatch none under train.async one_step or bounded trained samples
    of older weights with no behaviour correction (main before issue 29 loaded them)."""
    from combination_runs import BASE_YAML

    from megatron_qarl.errors import ConfigError
    from megatron_qarl.preflight.rules import load_config

    for mode in ("one_step", "bounded"):
        for loss in ("token_ppo", "gspo"):
            with pytest.raises(ConfigError, match=rf"^algo\.loss\.mismatch: 'none' with algo\.loss\.mode='{loss}' "
                                                  rf"and train\.async='{mode}': .*behaviour policy"):
                load_config(BASE_YAML, [f"train.async={mode}", f"algo.loss.mode={loss}"])
    assert load_config(BASE_YAML, ["train.async=one_step", "algo.loss.mode=token_ppo",
                                   "algo.loss.mismatch=tis_token"]).algo.loss.mismatch == "tis_token"
    assert load_config(BASE_YAML, ["train.async=off", "algo.loss.mode=token_ppo"]).algo.loss.mismatch == "none"
