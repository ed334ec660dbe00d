"""What a GPU user relies on, checked on a CPU machine: the Transformer Engine model's config is one Megatron
accepts (moe/te.py), the TE model says what is missing where TE is absent, the SGLang command lines of the
Qwen3-30B-A3B configs, and scripts/gpu_smoke.sh runs to its end (its checks skip without CUDA; the ``gpu`` test
runs them on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qarl.gpu import smoke as gpu_smoke
from megatron_qarl.launch.fleet import server_command
from megatron_qarl.moe.model import Qwen3MoeArch, build_model
from megatron_qarl.moe.model import transformer_config as transformer_config_of
from megatron_qarl.moe.te import te_config_overrides, te_transformer_config, transformer_engine_available
from megatron_qarl.preflight.rules import load_config

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "configs" / "models" / "qwen3-30b-a3b"
NO_TE = pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed here")


@pytest.mark.parametrize("fp8", [False, True])
def test_te_transformer_config_is_a_config_megatron_accepts(fp8, monkeypatch):
    """``moe.te.te_transformer_config``, the learner's TE config, through Megatron's own TransformerConfig
    validation (a renamed or refused field fails here, not on a GPU cluster). Megatron refuses apply_rope_fusion and
    moe_permute_fusion where TE's fused RoPE / permutation kernels are absent (rope_utils and moe_utils bind them
    when TE imports): stand-in kernels are bound there, its TE version checks see a current TE (>= 2.4, what
    setup.py's gpu extra installs), and ``require_transformer_engine`` passes."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe import moe_utils

    import megatron_qarl.moe.te as moe_te

    monkeypatch.setattr(moe_te, "require_transformer_engine", lambda: None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *a, **k: True)
    for kernel in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                   "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, kernel, lambda *a, **k: None, raising=False)
    config = te_transformer_config(transformer_config_of(Qwen3MoeArch.from_model_dir(QWEN)), fp8)
    assert {k: getattr(config, k) for k in te_config_overrides(fp8)} == te_config_overrides(fp8)
    assert (config.fp8, str(config.fp8_recipe)) == (("e4m3", "blockwise") if fp8 else (None, "delayed"))


@NO_TE
@pytest.mark.parametrize("te_fp8", [False, True])
def test_te_model_says_what_is_missing(te_fp8):
    arch = Qwen3MoeArch.from_model_dir(QWEN)
    with pytest.raises(ImportError, match=r"transformer-engine\[core_cu13,pytorch\]"):
        build_model(arch, dtype=torch.bfloat16, te=True, te_fp8=te_fp8)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sglang_commands_of_the_qwen3_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    bf16 = load_config("configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml", ["rollout.api_key=k3y",
                                                                     f"train.output_dir={tmp_path / 'run'}"])
    cmd = server_command(bf16, bf16.model.path, "0.0.0.0", 30001)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and _flag(cmd, "--model-path") == bf16.model.path
    assert (_flag(cmd, "--tp-size"), _flag(cmd, "--host"), _flag(cmd, "--port")) == ("2", "0.0.0.0", "30001")
    assert (_flag(cmd, "--mem-fraction-static"), _flag(cmd, "--max-running-requests")) == ("0.8", "32")
    assert _flag(cmd, "--random-seed") == "1234" and "--quantization" not in cmd
    key_file = Path(_flag(cmd, "--config"))  # the key in SGLang's --config YAML, 0600; never on the argv
    assert "k3y" not in " ".join(cmd) and "--api-key" not in cmd
    assert key_file.read_text() == "api-key: k3y\n" and key_file.stat().st_mode & 0o777 == 0o600
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
    assert checks["triton_refresh"].startswith("ok"), checks["triton_refresh"]
    for scheme in ("bf16", "w4a16", "w8a8_fp8", "w8a8_int8"):
        for check in gpu_smoke.LEARNER_CHECKS:
            assert checks[f"{check}[local,{scheme}]"].startswith("ok")


def test_the_gpu_learner_bench_runs_its_rows_on_a_cpu(tmp_path):
    """benchmarks/gpu_learner.py (scripts/gpu_smoke.sh --bench) runs here with --device cpu --small: each row in its
    own process, its launches (aten ops here) and host syncs per call, the quantizer alone; so a lent GPU's one call
    does not fail on the script. Its figures mean nothing for a GPU."""
    out = tmp_path / "gpu_learner.md"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_learner.py"), "--device", "cpu", "--small",
                           "--rows", "0,1", "--repeats", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out.read_text()
    learner_table = table.split("The quantizer alone")[0]
    rows = [line for line in learner_table.splitlines() if line.startswith(("| bf16 |", "| w4a16 |"))]
    assert len(rows) == 2 and "failed" not in table, table
    bf16, w4a16 = (r.split("|") for r in rows)
    assert w4a16[3].strip() == "torch" and w4a16[10].strip().endswith("x"), rows[1]  # auto on a CPU: torch's ops
    assert bf16[5].strip() == "2 x 128" and bf16[12].strip() == "-", rows[0]  # no MFU without a GPU's peak
    assert bf16[2].strip() == w4a16[2].strip() == "grouped", rows  # model.experts auto on a CPU
    assert float(bf16[8]) > 0 and "(" not in bf16[7], rows[0]  # tokens/s; no GPU-busy time on a CPU
    syncs = [int(cells[col].split("/")[1]) for cells in (bf16, w4a16) for col in (13, 14)]
    assert syncs[:2] == syncs[2:], rows  # fake quant adds no host sync to the forward or the step
    assert "The quantizer alone" in table and "GB/s" in table
    alone = [line.split("|")[1:3] for line in table.split("The quantizer alone")[1].splitlines()
             if line.startswith("| w")]
    assert [(a.strip(), b.strip()) for a, b in alone] == [(s, "torch") for s in ("w4a16", "w8a8_fp8", "w8a8_int8")]


def test_the_gpu_learner_bench_runs_the_sequential_experts_rows_on_a_cpu(tmp_path):
    """Issue 52: --rows experts runs bf16, w4a16 and w8a8_fp8 with Megatron's SequentialMLP, beside the scheme rows'
    default (grouped where it is fast): the experts column says what each learner built."""
    out = tmp_path / "gpu_experts.md"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_learner.py"), "--device", "cpu", "--small",
                           "--rows", "experts", "--repeats", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out.read_text()
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ") and "experts=" in line]
    assert [r[1].strip() for r in rows] == [f"{s} (experts=sequential)" for s in ("bf16", "w4a16", "w8a8_fp8")], table
    assert all(r[2].strip() == "sequential" for r in rows) and "failed" not in table and "quantizer alone" not in table


def test_the_gpu_learner_bench_runs_both_attention_rows_on_a_cpu(tmp_path, monkeypatch):
    """Issue 55: --rows attention runs the sdpa and the unfused core attention (bf16, one long sequence; --small: 512
    tokens on a CPU) with the same ops but the attention's; the MFU's peak is the GPU's datasheet figure by name."""
    import importlib.util

    import torch

    out = tmp_path / "gpu_attention.md"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_learner.py"), "--device", "cpu", "--small",
                           "--rows", "attention", "--repeats", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out.read_text()
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| bf16")]
    assert [r[1].strip() for r in rows] == ["bf16", "bf16 (attention=unfused)"] and "failed" not in table, table
    assert all(r[5].strip() == "1 x 512" for r in rows) and "quantizer alone" not in table
    sdpa_ops, unfused_ops = (int(r[13].split("/")[0]) for r in rows)
    assert sdpa_ops < unfused_ops, rows  # the fused kernel: fewer ops per log-prob forward (the step packs its row)
    spec = importlib.util.spec_from_file_location("gpu_learner", REPO / "benchmarks" / "gpu_learner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12),
                       ("NVIDIA H200", 989.4e12), ("Tesla V100-SXM2-16GB", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert bench.peak_flops("cuda") == peak, name
    assert bench.peak_flops("cpu") is None
