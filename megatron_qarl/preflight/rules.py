"""The rules between keys of different components, and ``load_config``, the one way a run's config is loaded.

config.py is the schema: each section's types and the checks that need only the config and the model's
config.json. What a backend can serve, what the planner says a server layout can hold, which async modes and
sampling settings a backend's answers support, and which losses stale samples need span components, so they live
here, where the config, the planner and every backend are known; the config module imports none of them
(tests/test_import_cycles.py). ``qarl preflight`` (this package) adds the checks of the environments a run executes
in. tests/test_combinations.py loads every combination of the run's main keys through ``validate_run`` and runs
the accepted ones (docs/training.md, "Which combinations of keys run").

    cfg = load_config("configs/cpu_default.yaml", ["parallel.tp=2", "optim.lr=1e-5"])

Every refusal is a ConfigError whose message starts with the dotted key and says why.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic import BaseModel

from megatron_qarl.config import QarlConfig, load_config_dict, validate_config
from megatron_qarl.errors import ConfigError
from megatron_qarl.moe.convert import param_maps
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.plan.memory import LayoutError, ServerLayout, check_server_layout
from megatron_qarl.qat.config import is_quantized
from megatron_qarl.rollout.vllm_launcher import CPU_INT4_GROUP


def check_sglang(cfg: QarlConfig) -> None:
    """``rollout.backend: sglang``: what SGLang 0.5.23's servers accept and can update."""
    ro = cfg.rollout
    if ro.sync.verify:
        raise ConfigError("rollout.sync.verify: a real SGLang server checksums its own fused, repacked and "
                          "sharded parameters, which the learner cannot reproduce; verification is for the "
                          "embedded server (docs/rollout.md, 'Against a real SGLang server')")
    if ro.sync.delta:
        raise ConfigError("rollout.sync.delta: SGLang 0.5.23 has no delta load format (its distributed update "
                          "loads every received tensor whole); delta sync is for the embedded server "
                          "(docs/rollout.md, 'Delta weight sync')")
    if ro.gpus_per_server < 1:
        raise ConfigError("rollout.gpus_per_server: sglang servers need at least 1 GPU")
    if ro.kv_cache_dtype != "auto" and ro.dtype != "bfloat16":
        raise ConfigError(f"rollout.kv_cache_dtype: {ro.kv_cache_dtype} with rollout.backend=sglang and "
                          f"rollout.dtype={ro.dtype}: the FP8 cache runs on SGLang's FlashInfer attention, which has "
                          "no float32 kernels; the learner models the cache's reads in rollout.dtype: use bfloat16")
    if ro.dp_size != 1:
        raise ConfigError(f"rollout.dp_size: {ro.dp_size}: SGLang's weight updates assert dp_size == 1 "
                          "(an updatable server is one data-parallel replica); raise rollout.servers instead")
    if ro.ep_size > ro.gpus_per_server or ro.gpus_per_server % ro.ep_size:
        why = " (SGLang's block-FP8 MoE needs tp % ep == 0)" if cfg.quant.scheme == "w8a8_fp8" else ""
        raise ConfigError(f"rollout.ep_size: {ro.ep_size} must divide rollout.gpus_per_server "
                          f"({ro.gpus_per_server}, SGLang's --tp-size){why}")
    try:
        check_server_layout(Qwen3MoeArch.from_model_dir(cfg.model.path), cfg.quant,
                            ServerLayout(tp=ro.gpus_per_server, ep=ro.ep_size))
    except LayoutError as err:
        raise ConfigError(f"rollout.gpus_per_server: SGLang cannot serve this model with "
                          f"--tp-size {ro.gpus_per_server} --ep-size {ro.ep_size}: {err}") from None


def check_vllm(cfg: QarlConfig) -> None:
    """``rollout.backend: vllm``: what vLLM 0.32 can serve and what its API returns (rollout/vllm_launcher.py)."""
    r, q = cfg.rollout, cfg.quant
    on_gpu = r.gpus_per_server > 0
    if q.scheme == "w8a8_fp8" and not on_gpu:
        raise ConfigError("quant.scheme: w8a8_fp8 with rollout.backend=vllm on CPU (rollout.gpus_per_server=0): "
                          "vLLM 0.32's CPU block-FP8 kernel cannot load this model (fused qkv scales) and needs "
                          "AMX-FP8; use w4a16, w8a8_int8 or bf16, or GPU servers")
    if q.scheme == "w4a16" and not on_gpu and q.group_size != CPU_INT4_GROUP:
        raise ConfigError(f"quant.group_size: {q.group_size}: vLLM 0.32's CPU int4 MoE kernel (CPUExpertsInt4) "
                          f"serves group size {CPU_INT4_GROUP} only")
    if q.scheme == "w4a16" and not q.symmetric:
        raise ConfigError("quant.symmetric: false: vLLM 0.32's int4 MoE kernels take symmetric codes only; "
                          "use symmetric W4A16 with rollout.backend=vllm")
    if r.sync.delta:
        raise ConfigError("rollout.sync.delta: vLLM 0.32's weight-transfer API loads whole tensors (its sparse "
                          "backend is CUDA-only); delta sync is for the embedded server")
    if r.sync.verify:
        raise ConfigError("rollout.sync.verify: vLLM checksums its own processed (repacked) parameters "
                          "(/weight_checker), which the learner cannot reproduce; verification is for the embedded "
                          "server")
    if cfg.algo.wants_routes:
        raise ConfigError("algo.routing_replay: routing replay / agreement needs the servers' routed experts, "
                          "which this project reads from SGLang and the embedded server only")
    if cfg.train.async_mode == "bounded":
        raise ConfigError("train.async: bounded with rollout.backend=vllm: requests stay in flight across a sync and "
                          "need SGLang's retract pause and per-token weight versions in meta_info, which vLLM 0.32's "
                          "API does not return; use train.async: one_step (each rollout between two syncs: the "
                          "trainer knows its version) or off")
    if r.dp_size != 1 or r.ep_size != 1:
        raise ConfigError("rollout.ep_size: vLLM servers here run one data-parallel replica each with "
                          "--tensor-parallel-size only (rollout.dp_size and ep_size stay 1)")
    sampling = r.sampling
    if sampling.top_p < 1.0 or sampling.top_k != -1:
        key, value = ("top_p", sampling.top_p) if sampling.top_p < 1.0 else ("top_k", sampling.top_k)
        raise ConfigError(f"rollout.sampling.{key}: {value} with rollout.backend=vllm: vLLM 0.32 returns the "
                          "log-probs of its top-k / top-p filtered, renormalized distribution (--logprobs-mode "
                          "processed_logprobs; vllm/v1/sample/ops/topk_topp_sampler.py), SGLang, the embedded server "
                          "and the learner those before the filter, so the two would differ by the log of the kept "
                          "mass on every token; with vLLM use top_p 1.0 and top_k -1")


def check_loss(cfg: QarlConfig) -> None:
    """The policy loss against ``train.async``: stale samples need a behaviour-policy correction."""
    loss, mode = cfg.algo.loss, cfg.train.async_mode
    if mode != "off" and loss.mode != "tbpo" and loss.mismatch == "none":
        fixes = "tis_seq or mis_seq" if loss.mode == "gspo" else "tis_token, mis_token, tis_seq or mis_seq"
        raise ConfigError(f"algo.loss.mismatch: 'none' with algo.loss.mode={loss.mode!r} and train.async={mode!r}: "
                          f"the samples were drawn by weights up to {cfg.train.staleness_bound} version(s) older than "
                          "the learner's, and this loss corrects for the behaviour policy only through "
                          f"algo.loss.mismatch (its ratio is to the learner's own log-probs); set it to {fixes}, or "
                          "use algo.loss.mode=tbpo (its mismatch band and weight are that correction), or "
                          "train.async=off")


@functools.lru_cache(maxsize=8)
def _arch(model_path: str) -> Qwen3MoeArch:
    return Qwen3MoeArch.from_model_dir(model_path)


def check_numerics(cfg: QarlConfig) -> None:
    """``numerics: exact`` (docs/numerics.md): both sides compute with megatron_qarl/numerics/, which only the
    embedded server and the learner's local spec on CPU do."""
    if cfg.numerics != "exact":
        return
    from megatron_qarl.numerics.ops import CHUNK

    if cfg.rollout.backend != "embedded":
        raise ConfigError(f"rollout.backend: {cfg.rollout.backend!r} with numerics=exact: the servers' kernels are "
                          "not ours (SGLang's deterministic inference makes a server batch-invariant, not equal to "
                          "our learner: docs/numerics.md); exact numerics run with rollout.backend=embedded")
    if cfg.learner_on_gpus:
        raise ConfigError(f"numerics: exact runs the learner on CPU only (megatron_qarl/numerics/ is CPU C), but "
                          f"{', '.join(cfg.gpu_run_keys)} make this a GPU run (docs/numerics.md, 'On GPUs')")
    if cfg.model.impl == "te" or cfg.model.te_fp8:
        raise ConfigError("model.impl: te (or model.te_fp8) with numerics=exact: the exact forward computes the "
                          "local spec's parameters with its own kernels; use model.impl local or auto")
    if cfg.algo.wants_routes:
        raise ConfigError("algo.routing_replay: with numerics=exact the learner's routers choose the servers' experts "
                          "bit for bit (same logits, same top-k tie-break); routing replay and agreement are for the "
                          "default numerics")
    if cfg.quant.enabled and not cfg.learner.aligned:
        raise ConfigError(f"learner.aligned: false with quant.scheme={cfg.quant.scheme!r} and numerics=exact: the "
                          "learner would compute with other weights than the servers; set it true")
    if cfg.quant.scheme.startswith("w8a8") and cfg.model.dtype != "float32":
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r} with quant.scheme={cfg.quant.scheme!r} and "
                          "numerics=exact: the learner's master weights would round the dequantized W8A8 weights to "
                          "their dtype, which the server (float32 dequantization) does not; use model.dtype float32")
    arch, tp = _arch(cfg.model.path), cfg.parallel.tp
    rows = {"num_attention_heads x head_dim": arch.num_attention_heads * arch.head_dim}
    if cfg.parallel.ep == 1:
        rows["moe_intermediate_size"] = arch.moe_intermediate_size
    for name, k in rows.items():
        if tp > 1 and k % (CHUNK * tp):
            raise ConfigError(f"parallel.tp: {tp} with numerics=exact: a row-parallel linear's K ({name} = {k}) must "
                              f"split into whole chunks of {CHUNK} per rank (the fixed reduction order)")


def check_kv_cache(cfg: QarlConfig) -> None:
    """``rollout.kv_cache_dtype`` (qat/kv_cache.py) against the backend and the learner: what the servers can hold
    and what the learner can reproduce."""
    r = cfg.rollout
    fp8 = r.kv_cache_dtype != "auto"
    if fp8 and r.backend == "vllm":
        raise ConfigError(f"rollout.kv_cache_dtype: {r.kv_cache_dtype} with rollout.backend=vllm: vLLM 0.32 takes "
                          "--kv-cache-dtype (its CPU attention lists fp8_e4m3 / fp8_e5m2 on AVX-512 or AMX CPUs), but "
                          "its cache's rounding is compiled code that is not SGLang's, which the learner reproduces: "
                          "measured on the tiny model with a float32 vLLM server, the aligned learner's per-token "
                          "mismatch (0.076 e4m3, 0.156 e5m2) exceeds an unaware learner's (0.049, 0.127; "
                          "docs/rollout.md, 'vLLM as a rollout backend'); use auto with vLLM")
    if fp8 and cfg.numerics == "exact" and not cfg.learner.aligned:
        raise ConfigError(f"learner.aligned: false with rollout.kv_cache_dtype={r.kv_cache_dtype} and numerics=exact: "
                          "the learner's attention would read other keys and values than the servers' FP8 cache; "
                          "set it true")


BACKEND_RULES = {"embedded": None, "sglang": check_sglang, "vllm": check_vllm}


def check_te_fp8_selection(cfg: QarlConfig) -> None:
    """``model.te_fp8`` against what ``quant.targets`` / ``quant.ignore`` select (the learner's build refused it
    before, qat/modules.py): ModelOpt converts every module of a Transformer Engine class the scheme quantizes
    anywhere, and a converted module's forward refuses TE's fp8 autocast, so each kind of TE linear (attention's qkv,
    its output projection, the experts' gate/up, their down) must be quantized in every layer and expert or in
    none. ConfigError naming the keys and one linear of each side."""
    if not cfg.model.te_fp8 or not cfg.quant.enabled:
        return
    kinds: dict[str, tuple[list[str], list[str]]] = {}
    for pm in param_maps(_arch(cfg.model.path), impl="te"):
        if pm.split in ("qkv", "tp_col", "fc1", "fc2"):
            on, off = kinds.setdefault(pm.split, ([], []))
            for name in pm.hf:
                (on if is_quantized(name, cfg.quant) else off).append(name.removesuffix(".weight"))
    for on, off in kinds.values():
        if on and off:
            raise ConfigError(f"quant.ignore: with model.te_fp8 the {len(off)} linear(s) it leaves in high precision, "
                              f"e.g. {off[0]}, share their Transformer Engine class with {len(on)} quantized ones, "
                              f"e.g. {on[0]}: ModelOpt converts them too, and their forward refuses TE's fp8 autocast. "
                              "Quantize that kind of linear in every layer or in none, or set model.te_fp8=false")


def check_logprob_semantics(cfg: QarlConfig) -> None:
    """Sampling settings under which the log-probs SGLang reports are not of the distribution the learner scores
    (log_softmax(z / T), ``rollout.sampling.temperature``). SGLang 0.5.23 takes a batch whose requests all have
    top_k <= 1 as greedy (``is_all_greedy`` in sglang/srt/sampling/sampling_batch_info.py) and then returns
    log_softmax(z), unscaled (``Sampler.forward``, sglang/srt/layers/sampler.py)."""
    s = cfg.rollout.sampling
    if s.top_k == 1 and s.temperature != 1.0:
        raise ConfigError(f"rollout.sampling.top_k: 1 with rollout.sampling.temperature={s.temperature}: SGLang "
                          "samples such a batch greedily and reports unscaled log-probs, while the learner divides its "
                          "logits by the temperature; the same samples come with temperature 1 (or raise top_k)")


def check_run(cfg: QarlConfig) -> QarlConfig:
    """Every rule between components on a schema-valid config; ConfigError naming the key, else ``cfg``."""
    check_loss(cfg)
    check_numerics(cfg)
    check_kv_cache(cfg)
    rule = BACKEND_RULES[cfg.rollout.backend]
    if rule is not None:
        rule(cfg)
    check_te_fp8_selection(cfg)
    check_logprob_semantics(cfg)
    return cfg


def validate_run(data: dict, base_dir: str | Path | None = None, cls: type[BaseModel] = QarlConfig):
    """``config.validate_config`` and then, for a whole run (``cls`` QarlConfig), ``check_run``."""
    cfg = validate_config(data, base_dir=base_dir, cls=cls)
    return check_run(cfg) if isinstance(cfg, QarlConfig) else cfg


def load_config(path: str | Path, overrides: list[str] | None = None, cls: type[BaseModel] = QarlConfig):
    """Load a YAML config, apply ``key.sub=value`` overrides, validate the schema and the rules between
    components (raises ConfigError naming the key)."""
    return validate_run(load_config_dict(path, overrides), cls=cls)
