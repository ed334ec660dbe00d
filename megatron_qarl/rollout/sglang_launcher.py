"""Start real SGLang servers on GPU nodes: `python -m sglang.launch_server` with the flags each
quantization scheme and layout needs. SGLang is a GPU-only optional extra; only the command line is
built here (and tested on CPU machines against SGLang's own argument parser), the process is started
only where SGLang is installed.

Offline-quantized checkpoints (from `qarl quantize` or the learner's export) carry their
``quantization_config`` in config.json, which SGLang reads by itself: no --quantization flag is
passed for them (adding one would override the checkpoint's). BF16 checkpoints run as they are.

Every server built here receives weight updates, and SGLang 0.5.23 constrains such servers:
- ``--dp-size`` stays 1: its weight-update group and updates assert ``dp_size == 1``
  (sglang/srt/managers/tokenizer_control_mixin.py); data parallelism is one server per replica.
- W4A16 MoE runs on ``--moe-runner-backend marlin``: the Triton runner does not undo its uint8
  conversion when a weight-update session begins, so updates would corrupt its experts
  (sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py).
- block-FP8 MoE needs ``tp % ep == 0`` (sglang/srt/model_executor/model_runner_components/moe_ep_setup.py).
- ``sampling_seed`` is honoured only with ``--enable-deterministic-inference``
  (sglang/srt/sampling/sampling_batch_info.py); the rollout manager seeds every sample, so the
  fleet turns it on (``deterministic_inference``).
- An FP8 KV cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``, rollout.kv_cache_dtype) runs on
  ``--attention-backend flashinfer``: deterministic inference otherwise picks fa3 on Hopper
  (arg_groups/overrides.py ``_deterministic_attention_backend``), which casts the queries to FP8 too
  (layers/attention/flashattention_backend.py ``prepare_paged_mha_query``) and serves e4m3 only; FlashInfer
  under deterministic inference reads every key and value from the paged cache, the new tokens' too
  (``use_ragged`` is off: layers/attention/flashinfer_backend.py), as the learner's fake quant and the
  embedded engine do (qat/kv_cache.py; docs/quantization.md "The KV cache").
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGLangServerSpec:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp: int = 1
    ep: int = 1
    dp: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    api_key_file: str | None = None  # the key in SGLang's --config YAML (utils/api_key.py), never on the argv
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0, multi-node only
    random_seed: int | None = None
    deterministic_inference: bool = False  # honour each request's sampling_seed
    return_routed_experts: bool = False  # answer return_routed_experts (routing replay, R3)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype; FP8 also picks --attention-backend flashinfer (module docstring)
    extra_args: tuple[str, ...] = ()


def checkpoint_scheme(model_path: str | Path) -> str:
    """The scheme a checkpoint was exported in, from its config.json quantization_config."""
    cfg_path = Path(model_path) / "config.json"
    try:
        qcfg = json.loads(cfg_path.read_text()).get("quantization_config")
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_path}: not found (expected a Hugging Face model directory)") from None
    if not qcfg:
        return "bf16"
    method = qcfg.get("quant_method")
    if method == "compressed-tensors":
        return "w4a16"
    if method == "fp8":
        return "w8a8_fp8"
    if method == "w8a8_int8":
        return "w8a8_int8"
    raise ValueError(f"{cfg_path}: quantization_config.quant_method {method!r} is not one of ours")


def launch_command(spec: SGLangServerSpec, python: str = sys.executable) -> list[str]:
    """The argv that starts one SGLang server (one node of it when nnodes > 1)."""
    if spec.tp < 1 or spec.ep < 1 or spec.dp < 1:
        raise ValueError(f"tp, ep, dp must be >= 1, got tp={spec.tp} ep={spec.ep} dp={spec.dp}")
    if spec.dp != 1:
        raise ValueError(f"dp={spec.dp}: SGLang's weight updates assert dp_size == 1; start one server per "
                         "data-parallel replica instead")
    if spec.ep > spec.tp:
        raise ValueError(f"ep_size {spec.ep} cannot exceed the server's GPUs tp={spec.tp}")
    if spec.nnodes > 1 and not spec.dist_init_addr:
        raise ValueError("dist_init_addr (host:port of node 0) is required when nnodes > 1")
    scheme = checkpoint_scheme(spec.model_path)  # fails early on a missing or foreign checkpoint
    if scheme == "w8a8_fp8" and spec.tp % spec.ep:
        raise ValueError(f"tp={spec.tp}, ep={spec.ep}: SGLang's block-FP8 MoE needs tp % ep == 0")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(spec.model_path), "--host", spec.host,
           "--port", str(spec.port), "--tp-size", str(spec.tp)]
    if spec.ep > 1:
        cmd += ["--ep-size", str(spec.ep)]
    if scheme == "w4a16":
        cmd += ["--moe-runner-backend", "marlin"]
    if spec.deterministic_inference:
        cmd += ["--enable-deterministic-inference"]
    if spec.return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    if spec.kv_cache_dtype != "auto":
        if not spec.deterministic_inference:
            raise ValueError(f"kv_cache_dtype {spec.kv_cache_dtype}: needs deterministic_inference (without it "
                             "FlashInfer's ragged prefill attends to a prefill's own keys and values unrounded)")
        if "--attention-backend" in spec.extra_args:
            raise ValueError(f"kv_cache_dtype {spec.kv_cache_dtype}: extra_args may not choose --attention-backend "
                             "(the FP8 cache's reads are FlashInfer's, which the learner models)")
        cmd += ["--kv-cache-dtype", spec.kv_cache_dtype, "--attention-backend", "flashinfer"]
    if spec.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.context_length is not None:
        cmd += ["--context-length", str(spec.context_length)]
    if spec.api_key_file:
        cmd += ["--config", str(spec.api_key_file)]
    if spec.nnodes > 1:
        cmd += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                "--dist-init-addr", spec.dist_init_addr]
    if spec.random_seed is not None:
        cmd += ["--random-seed", str(spec.random_seed)]
    return cmd + list(spec.extra_args)


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None
