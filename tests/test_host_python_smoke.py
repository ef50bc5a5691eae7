"""Smoke test of scripts/profile_host_python.py (benchmarks/host_python.py): the CPU measure of
an eager step's host Python runs, with the row engine serving every shape group (its stages
are the ones timed), and reports a time per step and per stage."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("flavor,fraction", [("normuon", "0.25"), ("muon", "1")])
def test_profile_host_python_times_the_row_engine_stages(flavor, fraction):
    cmd = [sys.executable, "scripts/profile_host_python.py", "--layers", "2", "--shrink", "64"]
    cmd += ["--flavor", flavor, "--fraction", fraction, "--steps", "2", "--rounds", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"4 shape groups: host ms per step .* median \d+\.\d+", out), out
    for stage in ("Dion3._accumulate", "RowEngineStages.pack", "RowEngineStages.update"):
        assert re.search(rf"{re.escape(stage)}\s+\d+\.\d+ ms\s+\d", out), (stage, out)


def test_profile_host_python_times_newton_schulz_per_batch():
    """``--part ns``: each of the model's Newton-Schulz batches (7b at f = 1/4: four) through the
    backend "auto" picks on a Hopper GPU, products stubbed, timed per step and per batch."""
    cmd = [sys.executable, "scripts/profile_host_python.py", "--part", "ns", "--fraction", "0.25"]
    cmd += ["--steps", "2", "--rounds", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"Newton-Schulz of 4 batches, f=0.25: host ms per step .* median \d+\.\d+", out), out
    # wq/wo's 1024 selected rows and w1/w3's 2752 (at the Gram side 2816) run CuteDSL's products,
    # wk/wv's 256 Triton's (dispatch.py's measured table)
    for rows, cols, backend in (
        (1024, 4096, "cute"),
        (2816, 4096, "cute"),
        (256, 4096, "triton"),
        (1024, 11008, "cute"),
    ):
        assert re.search(rf"{rows}\s+x\s+{cols}\s+{backend}\s+\d+\.\d+ ms", out), (rows, cols, out)
