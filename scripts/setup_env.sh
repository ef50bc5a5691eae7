#!/usr/bin/env bash
# Create a virtual environment with the project and its test tools; a later call returns at once.
#
#   bash scripts/setup_env.sh            # ./.venv: torchtitan 0.2.2, every package at its
#                                        # version in constraints.txt (CI, the README's commands)
#   TITAN=0.3 VENV=.venv03 bash scripts/setup_env.sh
#                                        # torchtitan 0.3.0, pinned by constraints-titan03.txt
#                                        # (scripts/test_titan03.sh)
#   LATEST=1 VENV=.venv-latest bash scripts/setup_env.sh
#                                        # the same packages at the newest versions pip resolves
#                                        # (scripts/test_latest.sh; not used by CI)
#
# torch stays 2.13.0 in all of them: pip takes its CPU build from the local wheel store, while an
# unpinned torch would pull a multi-GB CUDA build. On a machine with an NVIDIA GPU and a CUDA
# build of torch already installed, the venv reuses that torch and triton (system site packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TITAN=${TITAN:-0.2}
case $TITAN in
  0.2) TORCHTITAN=0.2.2; CONSTRAINTS=constraints.txt; extras=(torchao matplotlib) ;;
  0.3) TORCHTITAN=0.3.0; CONSTRAINTS=constraints-titan03.txt; extras=() ;;
  *) echo "TITAN=$TITAN: must be 0.2 or 0.3" >&2; exit 2 ;;
esac
VENV=${VENV:-.venv}
LATEST=${LATEST:-0}
if [[ -x $VENV/bin/python ]] && [[ -f $VENV/.ready ]] && [[ -x $VENV/bin/ruff ]] \
    && $VENV/bin/python -c "import dion3_titan, torchtitan, pytest, xdist" 2>/dev/null; then
  exit 0
fi
pins=(-c "$CONSTRAINTS")
if (( LATEST )); then
  pins=()
fi
if command -v nvidia-smi >/dev/null 2>&1 && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -m venv --system-site-packages "$VENV"
  if (( ! LATEST )); then  # the system's CUDA torch and its triton stay as they are
    grep -v -E '^(torch|triton)==' "$CONSTRAINTS" > "$VENV/constraints-gpu.txt"
    pins=(-c "$VENV/constraints-gpu.txt")
  fi
  "$VENV"/bin/python -m pip install -q "${pins[@]}" --upgrade pip setuptools
else
  "$PY" -m venv "$VENV"
  "$VENV"/bin/python -m pip install -q "${pins[@]}" --upgrade pip setuptools
  "$VENV"/bin/python -m pip install -q "${pins[@]}" torch==2.13.0 triton
  if [[ $TITAN == 0.2 ]]; then
    # CuteDSL, to compile our Hopper kernels without a GPU (tests/test_cute_compile.py). On a GPU
    # machine it is the user's choice, with the CUDA build that matches the driver (README).
    "$VENV"/bin/python -m pip install -q "${pins[@]}" nvidia-cutlass-dsl apache-tvm-ffi
  fi
fi
"$VENV"/bin/python -m pip install -q "${pins[@]}" "torchtitan==$TORCHTITAN" tokenizers tomli datasets numpy \
  pytest pytest-timeout pytest-xdist ruff "${extras[@]}"
# Built by the pinned setuptools (--build-constraint). -qq: setuptools prints a notice on every
# editable install, whatever the project; tests/test_packaging.py builds our wheel with every
# warning shown and fails on any.
"$VENV"/bin/python -m pip install -qq --no-deps --build-constraint "$CONSTRAINTS" -e .
"$VENV"/bin/python -c "import torch, triton, torchtitan, dion3_titan; print('environment ready in $VENV: torch', torch.__version__, '| triton', triton.__version__, '| torchtitan', torchtitan.__version__ if hasattr(torchtitan, '__version__') else '')"
touch "$VENV/.ready"
