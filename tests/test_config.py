"""Typed configuration: YAML + overrides, validated before any work, errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_qarl.config import QarlConfig, apply_overrides, validate_config
from megatron_qarl.errors import ConfigError
from megatron_qarl.preflight.rules import load_config

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_default_config_loads(tiny_model_dir):
    cfg = load_config(REPO / "configs" / "cpu_default.yaml")
    assert isinstance(cfg, QarlConfig)
    assert Path(cfg.model.path) == Path(tiny_model_dir).resolve()
    assert cfg.quant.scheme == "w4a16" and cfg.algo.loss.mode == "tbpo"


def test_overrides_are_typed(tiny_model_dir):
    cfg = load_config(REPO / "configs" / "cpu_default.yaml",
                      ["parallel.tp=2", "optim.lr=3e-4", "algo.loss.mode=token_ppo", "parallel.ep=2"])
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.optim.lr, cfg.algo.loss.mode) == (2, 2, 3e-4, "token_ppo")
    assert cfg.parallel.sp is True


@pytest.mark.parametrize("override, message", [
    # the three of the acceptance: bad type, unknown key, TP not dividing the KV groups
    ("parallel.tp=two", r"^parallel\.tp: Input should be a valid integer"),
    ("parallel.tensor_parallel=2", r"^parallel\.tensor_parallel: unknown key$"),
    ("parallel.tp=4", r"^parallel\.tp: 4 does not divide the model's num_key_value_heads \(2"),
    # more of the same family
    ("parallel.ep=3", r"^parallel\.ep: 3 does not divide the model's num_experts \(8"),
    ("parallel.tp=0", r"^parallel\.tp: Input should be greater than or equal to 1"),
    ("optim.lr=-1", r"^optim\.lr: Input should be greater than 0"),
    ("quant.scheme=w3a3", r"^quant\.scheme: Input should be"),
    ("algo.loss.mode=ppo2", r"^algo\.loss\.mode: Input should be"),
    ("model.path=/nonexistent", r"^model\.path: '/nonexistent': no Hugging Face config.json"),
    ("trainer.steps=3", r"^trainer: unknown key$"),
    ("optim.clip_grad=[1]", r"^optim\.clip_grad: Input should be a valid number"),
    ("train.async=fast", r"^train\.async: Input should be 'off', 'one_step' or 'bounded'"),
    ("train.max_staleness=0", r"^train\.max_staleness: Input should be greater than or equal to 1"),
])
def test_wrong_configs_name_the_key(override, message, tiny_model_dir):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(REPO / "configs" / "cpu_default.yaml", [override])
    assert len(str(info.value).splitlines()) == 1, str(info.value)


def test_train_async_modes_and_their_bounds(tiny_model_dir):
    """train.async: off (YAML's bare off, a boolean, included), one_step (bound 1), bounded (max_staleness); a
    sync retracts running requests only in bounded mode, and aborts them there too with R3 (SGLang's retract
    recomputes their routes; the manager continues them); the saved config spells the key train.async."""
    modes = {}
    for value in ("off", "one_step", "bounded"):
        cfg = load_config(REPO / "configs" / "cpu_default.yaml", [f"train.async={value}", "train.max_staleness=3"])
        modes[value] = (cfg.train.async_mode, cfg.train.staleness_bound, cfg.sync_pause_mode,
                        cfg.model_dump(mode="json")["train"]["async"])
    assert modes == {"off": ("off", 0, "abort", "off"), "one_step": ("one_step", 1, "abort", "one_step"),
                     "bounded": ("bounded", 3, "retract", "bounded")}
    for r3 in ("algo.routing_replay=true", "algo.routing_agreement=true"):
        assert load_config(REPO / "configs" / "cpu_default.yaml", ["train.async=bounded", r3]).sync_pause_mode == \
            "abort"
    assert load_config(REPO / "configs" / "cpu_default.yaml").train.async_mode == "off"
    # the default bound is the measured advice of docs/training.md ("When to use which": start with max_staleness=1)
    assert load_config(REPO / "configs" / "cpu_default.yaml", ["train.async=bounded"]).train.staleness_bound == 1


def test_yaml_errors_name_file_and_line(tmp_path):
    path = _write(tmp_path, "model:\n  path: x\nparallel: [1,\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:\d+: invalid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))


def test_missing_model_section(tmp_path):
    with pytest.raises(ConfigError, match=r"^model: required key is missing$"):
        load_config(_write(tmp_path, "seed: 1\n"))


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        apply_overrides({}, ["parallel.tp"])
    with pytest.raises(ConfigError, match="parallel.tp: is a value"):
        apply_overrides({"parallel": {"tp": 1}}, ["parallel.tp.x=2"])


def test_tp_without_sequence_parallel_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: must be on when tp > 1"):
        validate_config({"model": {"path": tiny_model_dir}, "parallel": {"tp": 2, "sequence_parallel": False}})


def test_delta_sync_is_refused_for_real_sglang_servers():
    cfg = load_config(REPO / "configs" / "cpu_default.yaml", ["rollout.sync.delta=true"])
    assert cfg.rollout.sync.delta
    with pytest.raises(ConfigError, match=r"^rollout\.sync\.delta: SGLang 0\.5\.23 has no delta load format"):
        load_config(REPO / "configs" / "cpu_default.yaml",
                    ["rollout.backend=sglang", "rollout.gpus_per_server=1", "rollout.sync.delta=true"])


def test_greedy_top_k_with_a_temperature_is_refused_as_sglang_reports_its_logprobs_unscaled():
    """SGLang 0.5.23 samples a batch whose requests all have top_k <= 1 greedily and reports log_softmax(z), while the
    learner scores log_softmax(z / T): refused at load, on every backend (the embedded engine is SGLang's stand-in)."""
    cfg = REPO / "configs" / "cpu_default.yaml"
    assert load_config(cfg, ["rollout.sampling.top_k=1"]).rollout.sampling.top_k == 1  # at T = 1 they agree
    with pytest.raises(ConfigError, match=r"^rollout\.sampling\.top_k: 1 with rollout\.sampling\.temperature=0\.8"):
        load_config(cfg, ["rollout.sampling.top_k=1", "rollout.sampling.temperature=0.8"])


def test_learner_memory_keys_are_typed_with_defaults(tiny_model_dir):
    cfg = load_config(REPO / "configs" / "cpu_default.yaml")
    le = cfg.learner
    assert (le.distributed_optimizer, le.optimizer_cpu_offload, le.recompute, le.recompute_num_layers) == (
        True, False, "none", 1)
    cfg = load_config(REPO / "configs" / "cpu_default.yaml",
                      ["learner.recompute=full", "learner.recompute_num_layers=2", "launch.gpus_per_learner_rank=1",
                       "learner.optimizer_cpu_offload=true", "learner.optimizer_offload_fraction=0.5"])
    assert (cfg.learner.recompute, cfg.learner.recompute_num_layers, cfg.learner.optimizer_offload_fraction) == (
        "full", 2, 0.5)
    assert cfg.learner_on_gpus and not load_config(REPO / "configs" / "cpu_default.yaml").learner_on_gpus


@pytest.mark.parametrize("overrides, message", [
    (["learner.recompute=partial"], r"^learner\.recompute: Input should be 'none', 'selective' or 'full'"),
    (["learner.recompute_num_layers=0"], r"^learner\.recompute_num_layers: Input should be greater than or equal"),
    (["learner.recompute=full", "learner.recompute_num_layers=3"],
     r"^learner\.recompute_num_layers: 3 does not divide the model's 4 layers"),
    (["learner.recompute=full", "algo.routing_replay=true"],
     r"^learner\.recompute: 'full' reruns each layer's router in the backward"),
    (["learner.optimizer_offload_fraction=0"], r"^learner\.optimizer_offload_fraction: Input should be greater than 0"),
    (["learner.optimizer_cpu_offload=true"],  # the CPU learner: nothing to offload, and no CUDA to offload with
     r"^learner\.optimizer_cpu_offload: moves optimizer states from the GPU to the host .* this is a CPU run "
     r"\(launch\.gpus_per_node=0, launch\.gpus_per_learner_rank=0, rollout\.backend embedded\)"),
    (["learner.optimizer_cpu_offload=true", "learner.distributed_optimizer=false", "launch.gpus_per_learner_rank=1"],
     r"^learner\.optimizer_cpu_offload: needs learner\.distributed_optimizer=true"),
    (["launch.gpu_gib=0"], r"^launch\.gpu_gib: Input should be greater than 0"),
])
def test_wrong_learner_memory_keys_name_the_key(overrides, message, tiny_model_dir):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(REPO / "configs" / "cpu_default.yaml", overrides)
    assert len(str(info.value).splitlines()) == 1, str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.te_fp8=true", "model.impl=te", "quant.scheme=w8a8_fp8"],
     r"^model\.te_fp8: quant\.scheme='w8a8_fp8' quantizes every Transformer Engine linear .*ModelOpt"),
    (["model.te_fp8=true", "model.impl=te", "quant.scheme=w8a8_int8", "algo.loss.mode=tbpo"],
     r"^model\.te_fp8: quant\.scheme='w8a8_int8' .*no GEMM would be left to run in FP8"),
    (["model.te_fp8=true", "model.impl=auto", "quant.scheme=bf16"],
     r"^model\.te_fp8: .*model\.impl='te' \(got model\.impl='auto'\)"),
])
def test_te_fp8_without_a_gemm_left_in_fp8_or_without_the_te_spec_is_refused(overrides, message, tiny_model_dir):
    """The W8A8 schemes fake-quantize every TE linear, each outside TE's fp8 autocast (ModelOpt's TE plugin refuses
    it): nothing left to FP8 (moe.te.check_te_fp8); refused at load, naming the keys."""
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "cpu_default.yaml", overrides)


@pytest.mark.parametrize("scheme", ["bf16", "w4a16"])
@pytest.mark.parametrize("aligned", [True, False])
def test_te_fp8_loads_for_bf16_and_w4a16_on_the_te_spec(scheme, aligned, tiny_model_dir):
    """w4a16 was refused before issue 29: its experts now run outside fp8 autocast, attention in FP8."""
    cfg = load_config(REPO / "configs" / "cpu_default.yaml",
                      ["model.te_fp8=true", "model.impl=te", f"quant.scheme={scheme}", f"learner.aligned={aligned}"])
    assert cfg.model.te_fp8 and cfg.quant.scheme == scheme
    assert load_config(REPO / "configs" / "cpu_default.yaml").model.te_fp8 is False


def test_te_fp8_with_one_layers_experts_left_in_high_precision_is_refused_at_load(tiny_model_dir):
    """Issue 38: quant.ignore leaving one layer's experts unquantized while the others are (w4a16, model.te_fp8):
    ModelOpt converts that layer's TE grouped linears too, whose forward refuses fp8 autocast. Before, the learner's
    build refused it (qat/modules.py); now config load does, naming the keys."""
    from megatron_qarl.qat.config import DEFAULT_IGNORE

    fp8 = ["model.te_fp8=true", "model.impl=te", "quant.scheme=w4a16"]
    ignore = [*DEFAULT_IGNORE["w4a16"], r"re:model\.layers\.1\.mlp\.experts\..*"]
    with pytest.raises(ConfigError, match=r"^quant\.ignore: with model\.te_fp8 .*model\.layers\.1\.mlp\.experts\.0\."
                                          r"gate_proj.*model\.layers\.0\.mlp\.experts\.0\.gate_proj.*te_fp8=false"):
        load_config(REPO / "configs" / "cpu_default.yaml", [*fp8, f"quant.ignore={json.dumps(ignore)}"])
    load_config(REPO / "configs" / "cpu_default.yaml", [f"quant.ignore={json.dumps(ignore)}"])  # without FP8: fine


def test_relative_paths_follow_one_rule_from_any_working_directory(tmp_path, monkeypatch, tiny_model_dir):
    """docs/training.md, "Paths": a relative path written in a config file is relative to that file's folder, one
    given on the command line to the current directory; both come out absolute, the same from any directory, and
    the Slurm launcher reads the same output directory as qarl train."""
    from megatron_qarl.launch.slurm import run_settings

    qwen = REPO / "configs" / "qwen3-30b-a3b" / "w4a16_tbpo_2x8.yaml"
    seen = []
    for where in (REPO, tmp_path):
        monkeypatch.chdir(where)
        cfg = load_config(qwen)
        seen.append((cfg.model.path, cfg.data.source, cfg.train.eval.data.source, cfg.train.output_dir,
                     run_settings(str(qwen), [])["output_dir"]))
    assert seen[0] == seen[1] == (str(REPO / "configs" / "models" / "qwen3-30b-a3b"),
                                  str(REPO / "data" / "dapo-math-17k" / "dapo-math-17k.parquet"),
                                  str(REPO / "data" / "aime-2024" / "aime-2024.parquet"),
                                  str(REPO / "runs" / "qwen3-30b-a3b" / "w4a16_tbpo_2x8"),
                                  str(REPO / "runs" / "qwen3-30b-a3b" / "w4a16_tbpo_2x8"))
    # a config of one's own, in its own folder: its paths are that folder's; the command line's are the cwd's
    mine = tmp_path / "exp" / "run.yaml"
    mine.parent.mkdir()
    (mine.parent / "model").symlink_to(tiny_model_dir)
    mine.write_text("model:\n  path: model\ndata:\n  source: prompts.jsonl\ntrain:\n  output_dir: out\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(mine, ["train.eval.data.source=held_out.jsonl"])
    assert (cfg.data.source, cfg.train.output_dir, cfg.train.eval.data.source) == (
        str(mine.parent / "prompts.jsonl"), str(mine.parent / "out"), str(tmp_path / "held_out.jsonl"))
    assert Path(cfg.model.path) == Path(tiny_model_dir).resolve()
    assert load_config(mine, ["data.source=synthetic"]).data.source == "synthetic"  # no path
    assert load_config(mine, ["train.output_dir=elsewhere"]).train.output_dir == str(tmp_path / "elsewhere")


def test_every_config_loads_and_its_bounds_nest():
    """Issue 53 item 1: every config under configs/ loads, and in each the bounds nest as docs/cluster.md's table
    says: one call of the learner ranks (launch.rank_timeout_s) outlasts every wait inside it."""
    root = Path(__file__).resolve().parents[1] / "configs"
    paths = sorted(root.rglob("*.yaml"))
    assert len(paths) == 22
    for path in paths:
        cfg = load_config(path)
        la, sync = cfg.launch, cfg.rollout.sync
        assert la.rank_timeout_s > max(la.collective_timeout_s, la.checkpoint_timeout_s, sync.peer_wait_s), path
        assert sync.peer_wait_s == 2 * sync.timeout_s + 60.0  # the formula the docs and the errors quote


@pytest.mark.parametrize("overrides, keys", [
    (["launch.rank_timeout_s=600", "launch.collective_timeout_s=600"],
     ("launch.rank_timeout_s: 600 s must be above launch.collective_timeout_s (600 s)",)),
    (["launch.rank_timeout_s=1000", "launch.checkpoint_timeout_s=1200"],
     ("launch.rank_timeout_s: 1000 s must be above launch.checkpoint_timeout_s (1200 s)",)),
    (["rollout.sync.timeout_s=900"],  # a sync's peer wait: 2 x 900 + 60 = 1860 s, past the default 1800 s
     ("launch.rank_timeout_s: 1800 s must be above the weight sync's peer wait 1860 s",
      "2 x rollout.sync.timeout_s = 2 x 900 s, + 60 s")),
])
def test_an_inverted_pair_of_bounds_is_refused_naming_both_keys(overrides, keys, tiny_model_dir):
    """Before issue 53 only launch.rank_timeout_s against launch.collective_timeout_s was checked: a sync bound of
    1800 s (the 30B configs') passed with a rank bound of 1800 s, and the checkpoint had no bound of its own."""
    with pytest.raises(ConfigError) as err:
        load_config("configs/cpu_default.yaml", overrides)
    for text in keys:
        assert text in str(err.value), str(err.value)


def test_a_sync_bound_above_the_collective_bound_loads(tiny_model_dir):
    """The learner ranks other than 0 no longer wait through the sync's I/O in the learner's collectives (they wait in
    the sync's own, bounded by the sync's peer wait), so rollout.sync.timeout_s may exceed launch.collective_timeout_s;
    what remains is that one call of the ranks outlasts the sync's peer wait."""
    cfg = load_config("configs/cpu_default.yaml", ["rollout.sync.timeout_s=600", "launch.collective_timeout_s=60"])
    assert cfg.rollout.sync.timeout_s > cfg.launch.collective_timeout_s
    assert cfg.rollout.sync.peer_wait_s == 1260.0 < cfg.launch.rank_timeout_s


@pytest.mark.parametrize("attention", ["sdpa", "unfused"])
def test_model_attention_chooses_the_local_specs_core_attention(attention, tiny_model_dir, monkeypatch):
    """Issue 55: model.attention (auto | sdpa | unfused) picks the local spec's core attention; auto is sdpa. An
    explicit one with model.impl=te is refused at load naming both keys (TE has its own fused attention); with
    model.impl=auto it builds the local spec even where Transformer Engine imports."""
    from megatron_qarl.moe import te
    from megatron_qarl.moe.attention import resolve_attention

    base = REPO / "configs" / "cpu_default.yaml"
    assert load_config(base).model.attention == "auto"
    assert load_config(base, [f"model.attention={attention}"]).model.attention == attention
    with pytest.raises(ConfigError, match=rf"^model\.attention: '{attention}' chooses the core attention of "
                                          r"Megatron's local spec, but model\.impl=te .*model\.impl=local$"):
        load_config(base, [f"model.attention={attention}", "model.impl=te"])
    assert load_config(base, ["model.impl=te"]).model.attention == "auto"
    with pytest.raises(ConfigError, match=r"^model\.attention: Input should be 'auto', 'sdpa' or 'unfused'"):
        load_config(base, ["model.attention=flash"])
    monkeypatch.setattr(te, "transformer_engine_available", lambda: True)
    assert te.resolve_impl("auto", attention) == "local" and te.resolve_impl("auto", "auto") == "te"
    assert resolve_attention(attention, "local") == attention and resolve_attention("auto", "local") == "sdpa"
    assert resolve_attention("auto", "te") == "te"
