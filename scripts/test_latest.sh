#!/usr/bin/env bash
# The suite against the newest versions pip resolves today (torch stays 2.13.0, see
# setup_env.sh), in ./.venv-latest. Not part of CI: a new triton, torchtitan or pytest release
# that breaks us shows up here as one failing run, while the pinned environment stays green.
# Delete .venv-latest to resolve again. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LATEST=1 VENV=.venv-latest bash scripts/setup_env.sh
.venv-latest/bin/python -m pip list --format=freeze 2>/dev/null | grep -i -E '^(torch|triton|torchtitan|torchao|pytest)=='
LATEST=1 VENV=.venv-latest exec bash scripts/test.sh "$@"
