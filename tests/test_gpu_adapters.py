"""What a GPU user relies on, checked on a CPU machine: the Transformer Engine model's settings are fields Megatron
accepts (moe/te.py), the TE model says what is missing where TE is absent, the SGLang command lines of the
Qwen3-30B-A3B configs, and scripts/gpu_smoke.sh runs to its end (its checks skip without CUDA; the ``gpu`` test
runs them on a GPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_qarl import gpu_smoke
from megatron_qarl.config import load_config
from megatron_qarl.launch.fleet import server_command
from megatron_qarl.moe.model import Qwen3MoeArch, build_model
from megatron_qarl.moe.te import te_config_overrides, te_fp8_settings, transformer_engine_available
from megatron_qarl.qat.config import QuantConfig

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "configs" / "models" / "qwen3-30b-a3b"
NO_TE = pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed here")


def _transformer_config_cls():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import TransformerConfig
    return TransformerConfig


@pytest.mark.parametrize("scheme", ["bf16", "w4a16", "w8a8_int8", "w8a8_fp8"])
def test_te_settings_are_fields_megatron_accepts(scheme):
    """A Megatron upgrade that renames a field the TE path sets fails here, not on a GPU cluster."""
    fields = {f.name for f in dataclasses.fields(_transformer_config_cls())}
    assert set(te_config_overrides(QuantConfig(scheme=scheme))) <= fields


def test_te_fp8_recipe_builds_a_megatron_config_and_refuses_other_block_sizes():
    settings = te_fp8_settings(QuantConfig(scheme="w8a8_fp8"))
    config = _transformer_config_cls()(num_layers=2, hidden_size=128, num_attention_heads=4, **settings)
    assert (config.fp8, config.fp8_recipe) == ("e4m3", "blockwise")  # e4m3 blocks, as SGLang's fp8 method serves
    with pytest.raises(ValueError, match="group_size: TE blockwise FP8 uses 128"):
        te_fp8_settings(QuantConfig(scheme="w8a8_fp8", group_size=64))


@NO_TE
@pytest.mark.parametrize("scheme", ["bf16", "w8a8_fp8"])
def test_te_model_says_what_is_missing(scheme):
    arch = Qwen3MoeArch.from_model_dir(QWEN)
    with pytest.raises(ImportError, match=r"transformer-engine\[pytorch\]"):
        build_model(arch, dtype=torch.bfloat16, te=QuantConfig(scheme=scheme))


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sglang_commands_of_the_qwen3_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    bf16 = load_config("configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml", ["rollout.api_key=k"])
    cmd = server_command(bf16, bf16.model.path, "0.0.0.0", 30001)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and _flag(cmd, "--model-path") == bf16.model.path
    assert (_flag(cmd, "--tp-size"), _flag(cmd, "--host"), _flag(cmd, "--port")) == ("2", "0.0.0.0", "30001")
    assert (_flag(cmd, "--mem-fraction-static"), _flag(cmd, "--max-running-requests")) == ("0.8", "32")
    assert _flag(cmd, "--api-key") == "k" and _flag(cmd, "--random-seed") == "1234" and "--quantization" not in cmd
    # a W4A16 export carries its quantization_config: SGLang reads it, no --quantization flag
    export = tmp_path / "w4a16"
    export.mkdir()
    cfg_json = json.loads((QWEN / "config.json").read_text())
    cfg_json["quantization_config"] = {"quant_method": "compressed-tensors"}
    (export / "config.json").write_text(json.dumps(cfg_json))
    w4 = load_config("configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml")
    cmd = server_command(w4, str(export), "0.0.0.0", 30002)
    assert _flag(cmd, "--tp-size") == "1" and _flag(cmd, "--max-running-requests") == "32"
    assert "--quantization" not in cmd


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: test_gpu_smoke runs the real checks")
def test_gpu_smoke_script_runs_through_on_a_machine_without_cuda():
    """What a user of a CPU machine sees: the wheels step, the report, a plain statement that there is no CUDA,
    every check skipped, the SGLang command, exit 0."""
    # --no-simulate: tests/test_simulated_device.py runs the simulated checks on their own
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_smoke.sh"), "--no-simulate"], capture_output=True,
                          text=True,
                          timeout=600, env={**os.environ, "PY": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== no CUDA on this machine: the GPU checks below skip" in proc.stdout
    assert json.dumps({"all": gpu_smoke.NO_CUDA})[1:-1] in proc.stdout  # the smoke's own words, in its JSON
    assert "-m sglang.launch_server --model-path" in proc.stdout and "== gpu_smoke: OK" in proc.stdout
    assert "gpu_wheels:" in proc.stdout  # it installed what was missing, or said why it did not


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: test_gpu_smoke runs the real checks")
def test_gpu_smoke_says_there_is_no_cuda():
    result = gpu_smoke.smoke()
    assert result["machine"]["cuda"] is False and result["checks"] == {"all": gpu_smoke.NO_CUDA}
    assert gpu_smoke.main(["smoke"]) == 0


@pytest.mark.gpu
def test_gpu_smoke():
    result = gpu_smoke.smoke()
    failed = {k: v for k, v in result["checks"].items() if v.startswith("FAILED")}
    assert not failed, failed
    checks = result["checks"]
    assert checks["fp8_gemm"].startswith("ok") and checks["nccl_broadcast"].startswith("ok")
    for scheme in ("bf16", "w4a16", "w8a8_fp8", "w8a8_int8"):
        for check in gpu_smoke.LEARNER_CHECKS:
            assert checks[f"{check}[local,{scheme}]"].startswith("ok")
