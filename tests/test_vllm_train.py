"""`qarl train` with ``rollout.backend=vllm``: two steps end to end with a real vLLM 0.32 server (its own
environment) serving the run's export, synced after every step through vLLM's weight-transfer API, with
``train.async=one_step`` (the mode rollout/vllm_launcher.py recommends: step 2 trains on samples drawn during step 1,
rescored by the server for the mismatch split) and an API key. On main before issue 29 this crashed at step 1:
vLLM's answers carry no weight version, every sample was "of unknown version" and regenerated, and the rescore sent
``logprob_start_len``, which the vLLM client refused. (train.async off on vLLM: tests/test_vllm_server.py's
combination runs.)

BF16 runs on any x86 CPU. vLLM 0.32's CPU kernels for our quantized MoE need AMX tiles: W4A16
(``CPUExpertsInt4``) and W8A8-INT8 (``CPUExpertsInt8``) both check ``torch.cpu._is_amx_tile_supported()`` in
``_supports_current_device`` (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py); the only other CPU
backends are AMD's zentorch ones, which vLLM enables on AMD CPUs with AVX-512 only (``_is_amd_zen_cpu``,
vllm/platforms/__init__.py). Those two cases are skipped, saying so, on CPUs without AMX.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_tools import VLLM_PYTHON, needs_vllm

from megatron_qarl.train.tracking import read_metrics

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
SMALL = ["launch.backend=local", "train.prompts_per_step=4", "rollout.sampling.n_samples=4", "train.eval.n=8",
         "train.eval.sampled_n=1", "train.eval.every=0", "rollout.max_batch_size=32", "train.checkpoint.every=0",
         "rollout.sampling.max_new_tokens=24", "rollout.startup_timeout_s=900", "train.steps=2"]
HAS_AMX = torch.cpu._is_amx_tile_supported()  # the very check vLLM's CPU int4 / int8 MoE experts make
NO_AMX = ("vLLM 0.32's CPU {kernel} MoE kernel needs AMX tiles, which this CPU lacks (vllm/model_executor/layers/"
          "fused_moe/experts/cpu_moe.py _supports_current_device; at load: 'No {what} MoE backend supports the "
          "deployment configuration')")


@needs_vllm
@pytest.mark.parametrize("config", [
    "cpu_bf16_rollout",
    pytest.param("cpu_w8a8_int8", marks=pytest.mark.skipif(
        not HAS_AMX, reason=NO_AMX.format(kernel="INT8 (CPUExpertsInt8)", what="Int8"))),
    pytest.param("cpu_default", marks=pytest.mark.skipif(
        not HAS_AMX, reason=NO_AMX.format(kernel="W4A16 (CPUExpertsInt4)", what="WNA16"))),
])
def test_qarl_train_two_steps_with_vllm_rollouts(config, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_qarl.cli", "train", "--config", f"configs/{config}.yaml", "--no-progress",
           f"train.output_dir={out}", "rollout.backend=vllm", f"rollout.server_python={VLLM_PYTHON}", *SMALL,
           "train.async=one_step", "rollout.api_key=qarl-test-key"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss/loss" in r}
    assert sorted(rows) == [1, 2]
    for step, r in rows.items():
        print(f"\n{config} step {step}: mismatch |dlogp| mean {r['mismatch/mismatch_tok_abs_mean']:.3e}, "
              f"reward {r['reward/mean']:.3f}, sync {r['sync/seconds']:.2f} s, responses {r['loss/num_responses']}")
        assert r["loss/num_responses"] == 16 and r["faults/prompts_lost"] == 0
        assert r["mismatch/mismatch_tok_abs_mean"] < 0.1  # the sampler's log-probs are the served policy's
        assert r["async/regenerated"] == 0  # every sample's version is known (the round's)
        assert r["mismatch_quant/mismatch_tok_abs_mean"] < 0.1  # the rescore at the learner's version (T = 1)
    # step 1 trained on its own samples, step 2 on samples drawn during step 1: one version behind
    assert rows[1]["staleness/token_frac_0"] == 1.0 and rows[2]["staleness/token_frac_1"] == 1.0
    assert rows[2]["sync/weight_version"] == 3.0  # the sync at the start (v1), then one after each step
    assert "version 0.32.0" in (out / "logs" / "server0.log").read_text(errors="replace")  # vLLM's banner
