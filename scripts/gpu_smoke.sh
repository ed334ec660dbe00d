#!/bin/bash
# GPU smoke check for a short lease on one GPU (under 8 minutes on one H200). The machine may have no network, its
# own torch (CUDA build) and no Transformer Engine or SGLang:
#   0. install the pure-Python wheels it lacks (megatron-core, nvidia-modelopt, pydantic, ...) from gpu_wheels/,
#      brought along with the repository (python scripts/gpu_wheels.py build, here; pip --no-index --no-deps
#      there: the machine's torch is never replaced)
#   1. what the machine offers (CUDA devices, NCCL, Transformer Engine and its FP8 scale format, SGLang)
#   1b. the learner checks of step 2 on a simulated CUDA device (megatron_qarl/gpu/simulated_device.py, the GPUs hidden;
#      about two minutes on 2 CPU cores, less on a GPU host): a CPU tensor mixed into device arithmetic fails here,
#      before the real GPU time is spent (--no-simulate skips it; the test suite runs it on its own)
#   2. FP8 GEMMs (SGLang's block recipe on torch._scaled_mm from our codes; TE's blockwise FP8 when installed), a
#      TP1/EP1 learner on CUDA for each quant scheme (local spec; TE spec too when installed): its first (aligned)
#      forward, its weight-sync payload through an NCCL group of world size 1, a train step, an R3 train step (the
#      routes replayed), the delta encoder, a checkpoint save; an NCCL broadcast over the visible GPUs
#   3. the SGLang launch command of a Qwen3-30B-A3B config (and whether sglang imports)
#   4. the tests marked gpu (a test file that cannot import here, for a package the machine lacks, is reported)
#   5. --bench: benchmarks/gpu_learner.py, the learner at Qwen3-30B-A3B layer shapes per scheme (forward, train step,
#      peak memory, kernel launches and host syncs per call, the quantizer's GB/s per scheme and refresh kernel; the
#      planner's phases on the device beside the simulation and the plan, a 30B config cut to one GPU), into
#      benchmarks/results/gpu_learner.md; the local spec's core attention, torch's fused SDPA against Megatron's
#      unfused one (bf16, one 4096-token sequence: step time, peak memory, MFU) into benchmarks/results/gpu_attention.md;
#      Megatron's SequentialMLP (bf16, w4a16, w8a8_fp8) beside the scheme rows' grouped experts (launches, step wall vs
#      GPU-busy time, tokens/s, MFU) into benchmarks/results/gpu_experts.md:
#      one device call does smoke and bench (a few minutes on an H200)
# Exits non-zero when a check that could run failed. On a machine without CUDA it says so and exits 0.
#   bash scripts/gpu_smoke.sh [--no-simulate] [--bench]     (PY=/path/to/python to choose the interpreter)
set -uo pipefail
SIMULATE=1
BENCH=0
for arg in "$@"; do
  case $arg in
    --no-simulate) SIMULATE=0 ;;
    --bench) BENCH=1 ;;
    *) echo "gpu_smoke.sh: unknown flag $arg (--no-simulate, --bench)"; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1
RC=0
echo "== wheels (gpu_wheels/)"
"$PY" scripts/gpu_wheels.py install || RC=1
echo "== machine"
"$PY" -m megatron_qarl.gpu.smoke report || RC=1
if [ "$SIMULATE" -eq 1 ]; then
  echo "== the learner checks on a simulated CUDA device (GPUs hidden)"
  CUDA_VISIBLE_DEVICES="" timeout 300 "$PY" -m megatron_qarl.gpu.smoke simulate || RC=1
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== no CUDA on this machine: the GPU checks below skip"
  CUDA=0
else
  CUDA=1
fi
echo "== FP8 GEMMs, CUDA learner steps (every scheme), sync payload over NCCL, NCCL broadcast"
timeout 420 "$PY" -m megatron_qarl.gpu.smoke smoke || RC=1
echo "== SGLang command of configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml"
"$PY" - <<'PY' || RC=1
from megatron_qarl.launch.fleet import server_command
from megatron_qarl.preflight.rules import load_config
from megatron_qarl.rollout.sglang_launcher import sglang_available
cfg = load_config("configs/qwen3-30b-a3b/bf16_tbpo_4x8.yaml", ["rollout.api_key=smoke"])
print(" ".join(server_command(cfg, cfg.model.path, "0.0.0.0", 30000)))
print("sglang importable:", sglang_available())
PY
echo "== tests marked gpu"
if [ "$CUDA" -eq 0 ]; then
  echo "skipped: no CUDA device"
elif ! "$PY" -c "import pytest" 2>/dev/null; then
  echo "skipped: pytest is not installed here"
else
  for f in $(grep -l "pytest.mark.gpu" tests/test_*.py); do
    # test_gpu_smoke repeats the smoke above: deselected
    out=$(timeout 120 "$PY" -m pytest -q -m gpu "$f" -p no:cacheprovider \
          --deselect tests/test_gpu_adapters.py::test_gpu_smoke 2>&1); rc=$?
    echo "$out" | tail -5
    case $rc in
      0|5) ;;  # 5: no gpu test selected in the file
      2|4) if echo "$out" | grep -q "ModuleNotFoundError"; then
             echo "skipped: $f needs a package this machine lacks ($(echo "$out" | grep -m1 -o "No module named [^ ]*"))"
           else RC=1; fi ;;
      *) RC=1 ;;
    esac
  done
fi
if [ "$BENCH" -eq 1 ]; then
  echo "== bench: benchmarks/gpu_learner.py -> benchmarks/results/gpu_learner.md"
  if [ "$CUDA" -eq 1 ]; then
    timeout 420 "$PY" benchmarks/gpu_learner.py --rows schemes --out benchmarks/results/gpu_learner.md || RC=1
    echo "== bench: Megatron's SequentialMLP beside the grouped experts -> benchmarks/results/gpu_experts.md"
    timeout 240 "$PY" benchmarks/gpu_learner.py --rows experts --out benchmarks/results/gpu_experts.md || RC=1
    echo "== bench: the core attention, sdpa and unfused -> benchmarks/results/gpu_attention.md"
    timeout 180 "$PY" benchmarks/gpu_learner.py --rows attention --out benchmarks/results/gpu_attention.md || RC=1
    echo "== bench: the planner on the device -> benchmarks/results/gpu_plan.md"
    # the simulation side was made ahead on a CPU (benchmarks/gpu_learner.py --plan-sim): only the device runs here.
    # 2 layers only: the 4-layer simulation ran out of the 24 GiB of the CPU machine that made the file (killed,
    # -9); with more host memory, make it there first (--plan-layers 2 4) and add 4 here
    timeout 240 "$PY" benchmarks/gpu_learner.py --rows none --plan configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml \
      --plan-layers 2 --plan-sim benchmarks/results/gpu_plan_sim.json --out benchmarks/results/gpu_plan.md || RC=1
  else
    echo "skipped: no CUDA device"
  fi
fi
echo "== gpu_smoke: $([ $RC -eq 0 ] && echo OK || echo FAILED)"
exit $RC
