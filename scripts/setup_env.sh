#!/usr/bin/env bash
# Create ./.venv with the project and its test tools, once; later calls return at once.
# On a machine with an NVIDIA GPU and a CUDA build of torch already installed, the venv reuses
# it (system site packages); otherwise it installs torch 2.13.0, whose CPU build pip takes
# from the local wheel store (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import dion3_titan, torchtitan, pytest" 2>/dev/null; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -m venv --system-site-packages .venv
else
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q triton 'torchtitan==0.2.2' 'torchao==0.18.0' tokenizers tomli pytest pytest-timeout matplotlib
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -c "import torch, torchtitan, dion3_titan; print('environment ready: torch', torch.__version__)"
