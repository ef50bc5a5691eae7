#!/usr/bin/env bash
# The test command: sets up the environment if needed (scripts/setup_env.sh; VENV, default
# ./.venv), then runs the whole suite (GPU tests skip without a GPU). Arguments go to pytest.
# Test files run in parallel (pytest-xdist: one file per worker at a time, as many workers as
# cores up to 4); PYTEST_WORKERS=0 runs them all in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/setup_env.sh
# the offline corpus the torchtitan tests train on, built once, before the workers start
"$VENV"/bin/python -m dion3_titan.data.build --size small >/dev/null
workers=${PYTEST_WORKERS:-auto}
parallel=()
if [[ $workers != 0 ]]; then
  parallel=(-n "$workers" --maxprocesses 4 --dist loadfile)
fi
exec "$VENV"/bin/python -m pytest -q -p no:cacheprovider --timeout 900 "${parallel[@]}" "$@"
