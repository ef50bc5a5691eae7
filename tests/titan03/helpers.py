"""Launch real torchtitan 0.3 training (torchrun, gloo on CPU) for the titan03 tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.spawn import free_port
from tests.titan_helpers import REPO, TitanRun, ensure_corpus, logged_losses  # noqa: F401


def run_titan03(config: str, dump_folder: Path, *overrides: str, nproc: int = 2, timeout: float = 600) -> TitanRun:
    """torchrun `nproc` ranks of `dion3_titan.train` with config function `config` of
    tests/titan03/inspect_recipes.py and command-line `overrides`."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--master_port", str(free_port()), "--local-ranks-filter", "0",
        "-m", "dion3_titan.train", "--module", "tests.titan03.inspect_recipes", "--config", config,
        "--dump_folder", str(dump_folder), *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks on a 2-core CI machine
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    records = []
    for r in range(nproc):
        path = dump_folder / "inspect" / f"rank{r}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
    return TitanRun(proc.returncode, proc.stdout + proc.stderr, records)
