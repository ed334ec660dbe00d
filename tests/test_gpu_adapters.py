"""megatron_qarl/gpu.py and scripts/gpu_smoke.sh on a CPU machine: the config mapping of the TE path (CUDA
fusions, blockwise FP8 recipe), the errors when TE is absent, the backend choice, the SGLang command lines of the
Qwen3-30B-A3B configs, and the smoke check (which skips without CUDA; the ``gpu`` test runs it on a GPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from launch.fleet import server_command
from megatron_qarl import gpu
from megatron_qarl.config import load_config
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import dist_backend
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.te import transformer_engine_available

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "configs" / "models" / "qwen3-30b-a3b"
NO_TE = pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed here")


def test_te_overrides_turn_cuda_fusions_on_and_map_fp8():
    bf16 = gpu.te_config_overrides(QuantConfig())
    assert bf16 == gpu.CUDA_FUSIONS and bf16["moe_grouped_gemm"] and bf16["moe_permute_fusion"]
    fp8 = gpu.te_config_overrides(QuantConfig(scheme="w8a8_fp8"), fused=False)
    assert fp8 == {"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False, "fp8_wgrad": True,
                   "first_last_layers_bf16": False, "moe_router_padding_for_fp8": True}
    assert "fp8" not in gpu.te_config_overrides(QuantConfig(scheme="w4a16"))  # weight-only int4: no TE FP8
    with pytest.raises(ValueError, match="group_size: TE blockwise FP8 uses 128-wide blocks"):
        gpu.te_config_overrides(QuantConfig(scheme="w8a8_fp8", group_size=64))


def test_te_overrides_are_megatron_config_fields():
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(gpu.te_config_overrides(QuantConfig(scheme="w8a8_fp8"))) <= fields


@NO_TE
def test_te_paths_say_what_is_missing():
    arch = Qwen3MoeArch.from_model_dir(QWEN)
    with pytest.raises(ImportError, match=r"transformer-engine\[pytorch\]"):
        gpu.te_layer_spec(arch)
    with pytest.raises(ImportError, match=r"transformer-engine\[pytorch\]"):
        gpu.te_transformer_config(arch, QuantConfig(scheme="w8a8_fp8"))


def test_backend_and_socket_env():
    assert dist_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert gpu.nccl_env("ib0") == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    assert gpu.nccl_env(None) == {}


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


def test_smoke_skips_without_cuda_and_the_script_parses(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: test_gpu_smoke runs the real check")
    assert gpu.main(["smoke"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checks"] == {"all": "skipped: no CUDA device"} and out["machine"]["backend"] == "gloo"
    script = REPO / "scripts" / "gpu_smoke.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "megatron_qarl.gpu smoke" in script.read_text()


@pytest.mark.gpu
def test_gpu_smoke():
    result = gpu.smoke()
    failed = {k: v for k, v in result["checks"].items() if v.startswith("FAILED")}
    assert not failed, failed
    checks = result["checks"]
    assert checks["megatron_cuda_step"].startswith("ok") and checks["nccl_broadcast"].startswith("ok")
