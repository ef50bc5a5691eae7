"""Command line of benchmarks/host_python.py (its docstring says what it does and how to run it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from benchmarks.host_python import main  # noqa: E402

if __name__ == "__main__":
    main()
