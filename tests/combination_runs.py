"""Two training steps of each planned combination (tests/combination_space.py), several runs in one child process:
the product's Trainer with its learner ranks (``LocalLearnerRanks`` in the process, or a ``RayCluster`` for
launch.backend ray), against rollout servers the test started once per scheme (local launch) or the Ray cluster's
own (ray). ``te=True``: the child first installs the Transformer Engine stand-ins (tests/te_standins.py) under
ModelOpt's real TE plugin, for model.te_fp8.

What a run reports, besides its metrics: per step, the largest |logp_old - logp_sampler| over the response tokens
the update received (``LearnerRanks.train`` is wrapped to read its batch), and after the run one more rollout at the
final weights scored by the learner (``fresh``): with float32 on both sides these are the aligned learner's
per-token mismatch, which must stay <= 1e-5 wherever the sampler's version is the learner's (step 1 in every mode,
step 2 with train.async off, the fresh rollout always)."""

from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
BASE_YAML = REPO / "configs" / "cpu_default.yaml"
KEY = "qarl-combos-key"
# float32 learner vs float32 server on the same weights: the mean per-token |logp_old - logp_sampler| (the trainer's
# mismatch/mismatch_tok_abs_mean) stays within PER_TOKEN, and every token within FP32_TOKEN (a log-softmax's float32
# rounding grows with the logits' magnitude: a rare token's log-prob of -10 or so moves by ~1e-5)
PER_TOKEN = 1e-5
FP32_TOKEN = 1e-4
# W8A8 quantizes activations round-to-nearest per token (group). The two sides' float32 arithmetic before that
# rounding differs in order (the learner's GEMMs are MKL's sgemm, whose kernel MKL picks by CPU; the server's the
# native low-bit kernels), so now and then an element lands on the other side of a rounding boundary and its code
# differs by one step, a flip: for e4m3 2^(e-3) x the group's scale amax/448, 32/448 = 7% of the amax in the top
# binade [256, 448]; for INT8 amax/127. It moves the token's log-prob, and through attention the later tokens' (whose
# activations then differ by more than rounding and flip again). The flip model (tests/w8a8_flips.py, checked by
# tests/test_w8a8_flips.py under the ISA knobs): the learner fed the server's codes agrees within FP32_TOKEN on every
# token, and a token with no flip upstream does as it is; it catches a 5% scale error on one expert, which no bound on
# the per-token differences alone separates from flips. Here, with those differences only: the median token within
# PER_TOKEN (measured: per-run medians <= 4.5e-6), and every token within W8A8_FLIP, twice the largest measured
# (0.251 of 47,600 tokens on an AMX Xeon: 5 ISA settings x 2 schemes x 10 weight versions x 5 seeds; 0.25 of about
# 86,000 on an AMD EPYC over 9 settings; run06's fresh rollout on the Xeon: 0.0698). docs/numerics.md, "W8A8:
# activation-code flips", has the distribution.
W8A8_FLIP = 0.5
# a small run: 2 prompts x 4 samples x 8 new tokens per step, exact-match rewards (no reward workers), the start
# and end evaluations on one prompt, a checkpoint at the end
SMALL = ["train.steps=2", "train.prompts_per_step=2", "rollout.sampling.n_samples=4",
         "rollout.sampling.max_new_tokens=24", "train.eval.n=1", "train.eval.sampled_n=0", "train.eval.every=0",
         "train.checkpoint.every=0", "reward.kind=exact", "rollout.max_batch_size=16", "train.learner_threads=1",
         "rollout.threads=1", "rollout.startup_timeout_s=300", "rollout.timeout_s=300", f"rollout.api_key={KEY}"]
KEEP = ("staleness/token_frac_0", "staleness/token_frac_1", "async/regenerated", "mismatch/mismatch_tok_abs_mean",
        "mismatch_quant/mismatch_tok_abs_mean", "mismatch_kv/mismatch_tok_abs_mean", "loss/num_responses",
        "loss/grad_norm", "sync/weight_version",
        "routing/agree_token")


class SharedServers:
    """Servers the test started (one per scheme, shared by the runs): the trainer's ServerFleet over their URLs."""

    def __init__(self, urls: list[str]):
        self.urls = list(urls)

    def alive(self) -> list[bool]:
        out = []
        for url in self.urls:
            try:
                out.append(httpx.get(url + "/health", timeout=30).status_code == 200)
            except httpx.HTTPError:
                out.append(False)
        return out

    def restart(self, i: int) -> str:
        raise RuntimeError(f"shared rollout server {self.urls[i]} failed (the test does not restart it)")

    def pids(self) -> list[int | None]:
        return [None] * len(self.urls)

    def close(self) -> None:
        pass


def _stats(d: torch.Tensor) -> dict[str, float]:
    """Per-token |logp_learner - logp_sampler|: the mean, the median, the largest, the share above PER_TOKEN."""
    a = d.abs().double()
    return {"mean": float(a.mean()), "median": float(a.median()), "max": float(a.max()),
            "over": float((a > PER_TOKEN).double().mean())}


# vLLM 0.32's quantized CPU MoE kernels (AMX CPUs only) are not the learner's numerics: its W4A16 experts run
# INT4_W4A8 (CPUExpertsInt4: "Internally uses int8 compute via fused_experts_cpu with INT4_W4A8", activations
# quantized to int8 per token) and both its W4A16 and INT8 experts need bf16 activations
# (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py). The learner matches SGLang's kernels, which the embedded
# engine copies; against vLLM's quantized ones it agrees as against a bf16 engine of other kernels: measured on an
# AMX Xeon (2026-12-06, the vLLM plan's 10 quantized runs, every checked step) per-token medians 3.6e-6 .. 1.1e-4,
# means 8.5e-4 .. 6.5e-3, maxima up to 0.29, the quantization part of the mismatch split up to 4.9e-3. The bound:
# median within FOREIGN_MEDIAN (9x the largest measured) and mean within FOREIGN_MEAN (3x); no per-token max (one
# int8 activation code of another rounding moves a token as a W8A8 flip does), and the split's quantization part
# within FOREIGN_MEAN.
FOREIGN_MEDIAN = 1e-3
FOREIGN_MEAN = 2e-2


def foreign_kernels(backend: str, scheme: str) -> bool:
    """The servers compute ``scheme`` with kernels whose numerics the learner does not follow (vLLM's quantized
    CPU MoE kernels)."""
    return backend == "vllm" and scheme != "bf16"


def mean_bound(scheme: str, kv_cache_dtype: str) -> float:
    """The bound of the mismatch split's quantization part (its mean per-token |dlogp|) where the two sides' flips
    enter: W8A8's activation codes or the FP8 KV cache's codes alone 1e-3; both, 1e-2: a flip of an activation code
    upstream moves a key by a whole code step, which puts it across an FP8 rounding boundary far more often, and a
    key's flip reaches every later position of its sequence through the attention (measured: 3.5e-3 at the first
    step of a w8a8_fp8 run with an e4m3 cache, median 2.4e-7, every token within the flips' bound)."""
    w8a8, kv = scheme.startswith("w8a8"), kv_cache_dtype != "auto"
    return 1e-2 if w8a8 and kv else 1e-3 if w8a8 or kv else PER_TOKEN


def within(stats: dict[str, float], scheme: str, foreign: bool = False, kv_cache_dtype: str = "auto") -> bool:
    """The bound of the module's constants for one set of per-token figures (W8A8, and an FP8 KV cache: the flips'
    measured bound; ``foreign``: servers of other kernels, ``foreign_kernels``). An FP8 KV cache rounds keys and
    values to 3 (e4m3) or 2 (e5m2) mantissa bits: a float32 key of the learner and the server's that straddle a
    rounding boundary take neighbouring codes, a flip of a whole fp8 step, as W8A8's activation codes do."""
    if foreign:
        return stats["median"] <= FOREIGN_MEDIAN and stats["mean"] <= FOREIGN_MEAN
    if scheme.startswith("w8a8") or kv_cache_dtype != "auto":
        return stats["median"] <= PER_TOKEN and stats["max"] <= W8A8_FLIP
    return stats["mean"] <= PER_TOKEN and stats["max"] <= FP32_TOKEN


def fresh_mismatch(trainer) -> dict[str, float]:
    """One more rollout at the final weights (after the last sync), scored by the learner as the step scores it (R3:
    replaying the servers' routes): the largest per-token |logp_learner - logp_sampler|."""
    from megatron_qarl.algo.routing import routes_batch
    from megatron_qarl.train.trainer import build_batch

    cfg = trainer.cfg
    prompts = [p.prompt_ids for p in trainer.stream.next_batch(2)]
    groups, _ = trainer.rollouts.rollout(prompts, cfg.rollout.sampling, 10_000, trainer.routes)
    batch, logp_sampler = build_batch(groups, trainer.pad_id)
    if trainer.routes is None:
        logp = trainer.learners.logprobs(batch.tokens_BS)
    else:
        r = trainer.routes
        server = routes_batch([s.routes for g in groups for s in g], batch.tokens_BS.shape[1], r.layers, r.topk)
        logp = trainer.learners.routing_logprobs(batch.tokens_BS, server)["logp_replay_BT"]
    return _stats((logp - logp_sampler)[batch.loss_mask_BT > 0])


def _launch(cfg, shared: list[str] | None):
    """(learner ranks, server fleet, closers) for one run: local launch against the shared servers; ray through
    the product's RayCluster (its own server actors), or, given ``shared`` (vLLM: one server start is 40-100 s), the
    learner rank as a Ray actor as RayCluster makes it, against the shared servers."""
    if cfg.launch.backend == "local":
        from megatron_qarl.launch.local import LocalLearnerRanks

        learners = LocalLearnerRanks(cfg)
        return learners, SharedServers(shared), [learners.close]
    import ray

    from megatron_qarl.launch.ray_launcher import RayCluster, RayLearnerRanks, _init_ray, ray_get
    from megatron_qarl.learner.worker import LearnerWorker
    from megatron_qarl.train.cli import rollout_model_dir

    if shared is None:
        cluster = RayCluster(cfg, rollout_model_dir(cfg))
        return cluster.learners, cluster.servers, [cluster.learners.close, cluster.close]
    _init_ray(cfg)
    actor = ray.remote(LearnerWorker).options(num_cpus=1, runtime_env={"env_vars": {"LOCAL_RANK": "0"}}).remote(
        cfg, 0, 1, cfg.train.learner_threads)
    learners = RayLearnerRanks([actor], cfg.launch.rank_timeout_s)
    try:
        learners.on_every_rank(LearnerWorker.setup, *ray_get(actor.address.remote(), cfg.launch.rank_timeout_s,
                                                             "the learner actor's LearnerWorker.address"))
    except BaseException:
        ray.kill(actor)
        raise
    return learners, SharedServers(shared), [learners.close, lambda: ray.kill(actor)]


def run_one(cfg, shared: list[str] | None) -> dict:
    """Two steps of ``cfg``; the per-step and fresh mismatch maxima, the kept metrics, the seconds taken."""
    from transformers import AutoTokenizer

    from megatron_qarl.train.tracking import read_metrics
    from megatron_qarl.train.trainer import Trainer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    learners, servers, closers = _launch(cfg, shared)
    steps: list[float] = []
    train = learners.train

    def recording(batch, loss_cfg, poison=False):
        mask = batch.loss_mask_BT > 0
        steps.append(_stats((batch.extra["logp_old_BT"] - batch.extra["logp_sampler_BT"])[mask]))
        return train(batch, loss_cfg, poison)

    learners.train = recording
    with contextlib.ExitStack() as stack:  # as qarl train closes: every closer runs even when one before it raises
        for close in reversed(closers):
            stack.callback(close)
        trainer = Trainer(cfg, learners, servers, tokenizer=tokenizer, progress=False)
        stack.callback(trainer.close)
        trainer.run()
        fresh = fresh_mismatch(trainer)
    rows = {r["step"]: r for r in read_metrics(Path(cfg.train.output_dir) / "metrics.jsonl") if "loss/loss" in r}
    return {"steps": steps, "fresh": fresh, "seconds": time.perf_counter() - t0,
            "metrics": {step: {k: r[k] for k in KEEP if k in r} for step, r in rows.items()}}


def run_group(runs: list[tuple[str, list[str]]], shared: dict[str, list[str]], te: bool, workdir: str,
              ray_shared: bool = False) -> list[dict]:
    """In a fresh process: each (name, overrides) run in turn (an error is reported, the next run goes on).
    ``shared``: quant.scheme -> the URLs of the test's servers for it (local launch; ray too with ``ray_shared``)."""
    if te:
        import te_standins

        te_standins.install_in_fresh_process()
    from megatron_qarl.preflight.rules import load_config

    torch.set_num_threads(1)
    results = []
    for name, overrides in runs:
        try:
            cfg = load_config(BASE_YAML, [*SMALL, *overrides, f"train.output_dir={workdir}/{name}"])
            import combination_space as cs

            key = cs.server_key(cfg.quant.scheme, cfg.numerics, cfg.rollout.kv_cache_dtype)
            servers = shared.get(key) if cfg.launch.backend == "local" or ray_shared else None
            results.append({"name": name, **run_one(cfg, servers)})
        except Exception:  # noqa: BLE001 - every run reports; the test fails on any error
            results.append({"name": name, "error": traceback.format_exc()[-6000:]})
    import sys

    if "ray" in sys.modules:
        import ray

        ray.shutdown()
    return results


# ------------------------------------------------------------------------------------ the test's side of a plan


def unrunnable_here(combo: tuple) -> str | None:
    """Why an accepted combination cannot run on this machine (None: it can)."""
    import combination_space as cs

    d = dict(zip(cs.KEYS, combo, strict=True))
    if d["model.te_fp8"] and d["launch.backend"] == "ray":
        return ("model.te_fp8 under launch.backend=ray: Transformer Engine is absent on this CPU and its stand-ins "
                "(tests/te_standins.py) are installed in the test's own process, not in Ray's learner actors")
    if d["rollout.backend"] == "vllm" and d["quant.scheme"] in ("w4a16", "w8a8_int8") and \
            not torch.cpu._is_amx_tile_supported():
        return (f"vLLM 0.32's CPU {d['quant.scheme']} MoE kernel needs AMX tiles, which this CPU lacks "
                "(vllm/model_executor/layers/fused_moe/experts/cpu_moe.py _supports_current_device)")
    return None


# the tests that run plans have pytest-timeout's 900 s (pyproject.toml): the groups share a budget below it, so a
# stuck group fails with its own stacks (tests/bounded_child.py) before pytest-timeout would end the test
GROUPS_BUDGET_S = 840.0


def run_groups(runs: list[tuple], shared: dict, workdir, ray_shared: bool = False, extra: tuple = (),
               budget_s: float = GROUPS_BUDGET_S) -> list[dict]:
    """Each group of runs (model.te_fp8, launch) in its own fresh process, one after the other, all of them
    within ``budget_s``: a group still running when it is spent is killed with what it started, and the error
    names its runs and where it waited (``bounded_child.run_in_child``); ``extra`` overrides every run gets last."""
    import collections

    import combination_space as cs
    from bounded_child import run_in_child

    groups = collections.defaultdict(list)
    for i, combo in enumerate(runs):
        d = dict(zip(cs.KEYS, combo, strict=True))
        groups[(d["model.te_fp8"], d["launch.backend"])].append((f"run{i:02d}", [*cs.as_overrides(combo), *extra]))
    results = []
    deadline = time.monotonic() + budget_s
    for (te, launch), group in sorted(groups.items()):
        name = f"combination runs {', '.join(n for n, _ in group)} (launch {launch}, te_fp8 {te})"
        results += run_in_child(run_group, group, shared, te, str(workdir), ray_shared, name=name,
                                timeout_s=max(1.0, deadline - time.monotonic()))
    return sorted(results, key=lambda r: r["name"])


def check_runs(runs: list[tuple], results: list[dict]) -> None:
    """Every run trained two steps, and its aligned learner agreed with the servers per token wherever the sampler's
    weights were the learner's (module docstring; ``within``); the mismatch split's quantization part too, at every
    temperature (the rescore's prompt log-probs are unscaled in SGLang and vLLM, and the split compares them with
    the learner's at temperature 1: issue 29 item 7)."""
    import combination_space as cs

    problems = []
    for combo, r in zip(runs, results, strict=True):
        d, where = dict(zip(cs.KEYS, combo, strict=True)), f"{r['name']} ({cs.describe(combo)})"
        if "error" in r:
            problems.append(f"{where}: {r['error']}")
            continue
        print(f"{where}: {r['seconds']:.1f} s; per-token |dlogp| mean / median / max (share > 1e-5): "
              + ", ".join(f"{k} {s['mean']:.1e} / {s['median']:.1e} / {s['max']:.1e} ({s['over']:.2f})" for k, s in
                          (("step 1", r["steps"][0]), ("step 2", r["steps"][-1]), ("after", r["fresh"]))))
        checked = [r["steps"][0], r["fresh"]] + ([r["steps"][1]] if d["train.async"] == "off" else [])
        kv = d["rollout.kv_cache_dtype"]
        foreign = foreign_kernels(d["rollout.backend"], d["quant.scheme"])
        bad = [s for s in checked if not within(s, d["quant.scheme"], foreign, kv)
               or (d["numerics"] == "exact" and s["max"] != 0.0)]  # exact: not one token's log-prob differs
        if len(r["steps"]) != 2 or sorted(r["metrics"]) != [1, 2] or bad:
            problems.append(f"{where}: steps {r['steps']}, fresh {r['fresh']}, metrics {r['metrics']}")
        for step, m in r["metrics"].items():
            quant = m.get("mismatch_quant/mismatch_tok_abs_mean")
            if quant is not None and quant > (FOREIGN_MEAN if foreign else mean_bound(d["quant.scheme"], kv)):
                problems.append(f"{where}: step {step} mismatch_quant {quant}")
            if d["train.async"] != "off" and m.get("async/regenerated", 0) != 0:
                problems.append(f"{where}: step {step} regenerated {m['async/regenerated']} samples")
    assert not problems, "\n".join(problems)
