#!/usr/bin/env bash
# The torchtitan 0.3 tests: sets up ./.venv03 if needed, then runs tests/titan03 (real 0.3
# training on gloo ranks: 20 steps with the loss falling, exact resume, a bad optimizer kwarg
# stopping before step 1, FSDP x TP and EP on 4 ranks, the fused-weight splits).
set -euo pipefail
cd "$(dirname "$0")/.."
TITAN=0.3 bash scripts/setup_env.sh
exec .venv03/bin/python -m pytest -q -p no:cacheprovider --timeout 900 tests/titan03 "$@"
