#!/bin/bash
# GPU smoke check, for a CUDA machine with the project installed (pip install -e ".[gpu]" for TE and SGLang):
#   1. what the machine offers (CUDA devices, NCCL, Transformer Engine, SGLang)
#   2. a CUDA Megatron train step of the tiny Qwen3-MoE (Megatron-Core local spec, NCCL process group)
#   3. an NCCL broadcast from GPU 0 to every visible GPU (the weight-update group's transport)
#   4. with Transformer Engine: the same step with Megatron's TE layer spec, then with TE's blockwise FP8 recipe
#   5. the SGLang launch command of a Qwen3-30B-A3B config (and whether sglang imports)
#   6. the tests marked gpu
# Exits non-zero when a check that could run failed. On a machine without CUDA it says so and exits 0.
#   bash scripts/gpu_smoke.sh            (PY=/path/to/python to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RC=0
echo "== machine"
"$PY" -m megatron_qarl.gpu_smoke report || RC=1
echo "== Megatron CUDA step, NCCL broadcast, TE (+FP8) step"
timeout 900 "$PY" -m megatron_qarl.gpu_smoke smoke || RC=1
echo "== SGLang command of configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml"
"$PY" - <<'PY' || RC=1
from megatron_qarl.launch.fleet import server_command
from megatron_qarl.config import load_config
from megatron_qarl.rollout.sglang_launcher import sglang_available
cfg = load_config("configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml", ["rollout.api_key=smoke"])
print(" ".join(server_command(cfg, cfg.model.path, "0.0.0.0", 30000)))
print("sglang importable:", sglang_available())
PY
echo "== tests marked gpu"
timeout 900 "$PY" -m pytest -q -m gpu tests/ -p no:cacheprovider
case $? in 0|5) ;; *) RC=1 ;; esac   # 5: no gpu test collected
echo "== gpu_smoke: $([ $RC -eq 0 ] && echo OK || echo FAILED)"
exit $RC
