#!/usr/bin/env bash
# The torchtitan 0.3 tests (tests/titan03, skipped by the 0.2 suite) in their own environment,
# ./.venv03, pinned by constraints-titan03.txt: real 0.3 training on gloo ranks (20 steps with
# the loss falling, exact resume, a bad optimizer kwarg stopping before step 1, FSDP x TP and EP
# on 4 ranks, the fused-weight splits). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TITAN=0.3 VENV=.venv03 exec bash scripts/test.sh tests/titan03 "$@"
