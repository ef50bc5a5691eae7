#!/usr/bin/env bash
# Create ./.venv03: the project with torchtitan 0.3 (every package at its version in
# constraints-titan03.txt), for the 0.3 integration tests (scripts/test_titan03.sh). A later call
# returns at once. ./.venv (scripts/setup_env.sh) keeps torchtitan 0.2.2 for the main suite.
#
# torch stays 2.13.0: pip takes its CPU build from the local wheel store, while an unpinned torch
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv03}
if [[ -x $VENV/bin/python ]] && [[ -f $VENV/.ready ]] && $VENV/bin/python -c "import dion3_titan, torchtitan, pytest" 2>/dev/null; then
  exit 0
fi
pins=(-c constraints-titan03.txt)
"$PY" -m venv "$VENV"
"$VENV"/bin/python -m pip install -q "${pins[@]}" torch==2.13.0 triton
"$VENV"/bin/python -m pip install -q "${pins[@]}" 'torchtitan==0.3.0' tokenizers tomli datasets numpy \
  pytest pytest-timeout
"$VENV"/bin/python -m pip install -q --no-deps -e .
"$VENV"/bin/python -c "import torch, torchtitan, dion3_titan.titan03.recipes; print('0.3 environment ready: torch', torch.__version__)"
touch "$VENV/.ready"
