#!/usr/bin/env bash
# The test command: sets up ./.venv if needed, then runs the whole suite (GPU tests skip
# without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 "$@"
