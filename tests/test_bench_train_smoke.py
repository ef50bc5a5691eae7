"""Smoke test of scripts/bench_train.py (benchmarks/train_throughput.py) on the CPU: real
torchtitan training of a tiny llama3 with AdamW and Dion3 f = 1/4, 4 steps each, one process per
run. Every row must come back measured, with positive numbers and a finite loss."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import train_throughput as bench

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("adamw", "dion3_f1/4")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[str, dict]:
    """(stdout, JSON) of one --tiny run on the CPU (the script is a second process so that it
    sees no GPU, whatever this one has)."""
    out = tmp_path_factory.mktemp("bench_train") / "tiny.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--tiny", "--only", ",".join(RUNS)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout, json.loads(out.read_text())


def test_rows_are_measured(result: tuple[str, dict]) -> None:
    _, data = result
    meta, rows = data["meta"], {r["name"]: r for r in data["results"]}
    assert meta["model"] == "tiny" and meta["steps"] == 4 and meta["memory"] == "process peak RSS"
    assert set(rows) == set(RUNS)
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["timed_steps"] == 2 and len(r["record"]["steps"]) == 4
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["optimizer_ms"] > 0
        assert 0 < r["optimizer_share"] < 1  # the optimizer is part of the step
        assert r["step_ms_iqr"][0] <= r["step_ms"] <= r["step_ms_iqr"][1]
        assert r["peak_gb"] > 0 and math.isfinite(r["final_loss"])
        assert r["cuda_graph"] is False  # no GPU
        assert r["record"]["tokens_per_step"] == 2 * 64  # --tiny: batch 2, seq 64
    # the runs differ only in the optimizer: same model
    assert rows["adamw"]["record"]["params"] == rows["dion3_f1/4"]["record"]["params"] > 0
    assert rows["dion3_f1/4"]["config"]["optimizer"]["fraction"] == 0.25


def test_table(result: tuple[str, dict]) -> None:
    stdout, _ = result
    assert "| Optimizer | CUDA graph | tokens/s |" in stdout
    for run in bench.RUNS:
        assert (f"| {run.label} |" in stdout) == (run.name in RUNS)


def test_config_round_trips_through_toml(tmp_path: Path) -> None:
    """The written config.toml is what torchtitan reads: it parses back to the same dict."""
    corpus = tmp_path / "corpus"
    for on_gpu in (False, True):
        for run in bench.RUNS:
            args = bench.parse_args(["--tiny"])
            cfg = bench.job_config(run, args, corpus, tmp_path / "dump", on_gpu)
            path = tmp_path / "config.toml"
            bench.write_toml(cfg, path)
            assert bench.tomllib.loads(path.read_text()) == cfg
            assert cfg["model"]["flavor"] == bench.FLAVOR and not cfg["validation"]["enable"]
            assert cfg["training"]["seq_len"] == 64 and cfg["training"]["local_batch_size"] == 2
