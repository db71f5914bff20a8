#!/usr/bin/env bash
# Installs tp_train and its dependencies into the current Python environment.
# torch goes first: on a machine without an NVIDIA GPU we install the CPU build, because letting pip resolve
# a loose "torch" requirement pulls a multi-GB CUDA build. Override with TORCH_SPEC (e.g. TORCH_SPEC=torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -z "${TORCH_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        TORCH_SPEC="torch"
    else
        TORCH_SPEC="torch==2.13.0"
    fi
fi
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "$TORCH_SPEC"
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"
