"""Smoke test of scripts/bench_train.py (benchmarks/train_throughput.py) on the CPU: real
torchtitan training of a tiny llama3 with AdamW, Dion3 f = 1/4 and 1/8, and Dion3 f = 1/4 with
torchtitan's compile on, 4 steps each, one process per run. Every row must come back measured,
with positive numbers and finite losses; the compiled row compiles in its warm-up only."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import train_throughput as bench

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("adamw", "dion3_f1/4", "dion3_f1/8", "dion3_f1/4+compile")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[str, dict]:
    """(stdout, JSON) of one --tiny run on the CPU (the script is a second process so that it
    sees no GPU, whatever this one has)."""
    out = tmp_path_factory.mktemp("bench_train") / "tiny.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--tiny", "--only", ",".join(RUNS)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
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
        assert r["peak_gb"] > 0 and math.isfinite(r["first_loss"]) and math.isfinite(r["final_loss"])
        assert r["first_loss"] == r["record"]["steps"][0]["loss"]
        assert r["cuda_graph"] is False and r["cuda_graph_captured"] is False  # no GPU
        assert r["record"]["tokens_per_step"] == 2 * 64  # --tiny: batch 2, seq 64
        compiled = r["name"].endswith("+compile")
        assert r["compiled"] is compiled and r["config"]["compile"]["enable"] is compiled
        assert r["compiles_in_timed_steps"] == 0
        # torch.compile compiles in the first step (forward graphs of a block and of the loss)
        assert (r["record"]["steps"][0]["compiles"] >= 2) if compiled else r["compiles_in_warmup"] == 0
    # the runs differ only in the optimizer and compile: same model
    assert len({r["record"]["params"] for r in rows.values()}) == 1 and rows["adamw"]["record"]["params"] > 0
    assert rows["dion3_f1/4"]["config"]["optimizer"]["fraction"] == 0.25
    assert rows["dion3_f1/8"]["config"]["optimizer"]["fraction"] == 0.125
    # compiled training is the same training (fp32: kernels only reorder sums)
    eager, compiled = ([s["loss"] for s in rows[n]["record"]["steps"]] for n in ("dion3_f1/4", "dion3_f1/4+compile"))
    assert compiled == pytest.approx(eager, rel=1e-4), (eager, compiled)


def test_compiling_in_timed_steps_fails_the_row() -> None:
    """A compilation after the warm-up (a recompile) would put compile time into the medians; a
    compiled row with no compilation counted means the count is broken."""
    run = next(r for r in bench.RUNS if r.compile)
    steps = [{"step_ms": 10.0, "optimizer_ms": 1.0, "peak_gb": 1.0, "loss": 8.0, "compiles": c} for c in (3, 3, 4, 4)]
    record = {
        "steps": steps,
        "compiled": True,
        "cuda_graph": False,
        "cuda_graph_captured": False,
        "tokens_per_step": 128,
    }
    late = bench.summarize(run, record, warmup=2)
    assert late["status"].startswith("failed: 1 compilations in timed steps") and late["compiles_in_warmup"] == 3
    assert bench.summarize(run, record, warmup=3)["status"] == "ok"
    assert bench.summarize(run, record, warmup=0)["compiles_in_timed_steps"] == 4
    for step in steps:
        step["compiles"] = 0
    assert bench.summarize(run, record, warmup=2)["status"] == "failed: compiled, but no compilation counted"


def test_table(result: tuple[str, dict]) -> None:
    stdout, _ = result
    assert "| Optimizer | compiled | CUDA graph | tokens/s |" in stdout and "| loss at step 1 | loss at end |" in stdout
    assert "| Dion3 f = 1/4 (NorMuon), compiled | yes |" in stdout
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
            assert cfg["compile"] == {"enable": run.compile, "components": ["model", "loss"]}


def test_only_picks_runs_and_default_is_all() -> None:
    assert bench.selected_runs(None) == bench.RUNS
    names = [r.name for r in bench.RUNS]
    assert {"dion3_f1/8", "adamw+compile", "dion3_f1/4+compile"} <= set(names) and len(set(names)) == len(names)
    picked = bench.selected_runs("dion3_f1/4+compile,adamw+compile")
    assert [r.name for r in picked] == ["adamw+compile", "dion3_f1/4+compile"] and all(r.compile for r in picked)
    with pytest.raises(SystemExit, match="unknown run"):
        bench.selected_runs("adamw,dion3+compile")
    # the controls run only when named, and change only what their name says
    assert not {r.name for r in bench.CONTROL_RUNS} & set(names)
    controls = bench.selected_runs("adamw+lr0,dion3_f1/8+lr0,dion3_f1/8+eager")
    assert [r.name for r in controls] == ["adamw+lr0", "dion3_f1/8+lr0", "dion3_f1/8+eager"]
    args = bench.parse_args(["--tiny"])
    cfgs = {r.name: bench.job_config(r, args, Path("corpus"), Path("dump"), True)["optimizer"] for r in controls}
    assert cfgs["adamw+lr0"]["lr"] == 0.0 and cfgs["adamw+lr0"]["name"] == "AdamW"
    assert cfgs["dion3_f1/8+lr0"]["lr"] == 0.0 and cfgs["dion3_f1/8+lr0"]["adamw_lr"] == 0.0
    assert cfgs["dion3_f1/8+lr0"]["fraction"] == 0.125 and "cuda_graph" not in cfgs["dion3_f1/8+lr0"]
    assert cfgs["dion3_f1/8+eager"]["cuda_graph"] is False and cfgs["dion3_f1/8+eager"]["lr"] > 0


def test_rounds_alternate_their_order_and_pool_every_timed_step() -> None:
    """--rounds: A B, B A, A B; the pooled row takes the median over every timed step of every
    round of a run, and its share of AdamW's tokens/s from those medians."""
    runs = bench.selected_runs("adamw,dion3_f1/8")
    order = [(r, run.name) for r, run in bench.schedule(runs, 3)]
    assert order == [
        (0, "adamw"),
        (0, "dion3_f1/8"),
        (1, "dion3_f1/8"),
        (1, "adamw"),
        (2, "adamw"),
        (2, "dion3_f1/8"),
    ]
    assert bench.parse_args(["--rounds", "2"]).rounds == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])

    def row(name: str, step_ms: list[float], status: str = "ok") -> dict:
        steps = [{"step_ms": 99.0, "optimizer_ms": 9.0}] + [{"step_ms": t, "optimizer_ms": t / 10} for t in step_ms]
        return {
            "name": name,
            "label": name,
            "status": status,
            "tokens_per_s": 1000 / (statistics.median(step_ms) / 1e3),
            "record": {"tokens_per_step": 1000, "steps": steps},
        }

    rows = [
        row("adamw", [100.0, 104.0]),
        row("dion3_f1/8", [101.0, 103.0]),
        row("dion3_f1/8", [110.0, 112.0]),
        row("adamw", [108.0, 120.0]),
        row("dion3_f1/8", [1.0], status="failed: exit code 1"),  # left out of the pool
    ]
    pool = {p["name"]: p for p in bench.pooled(rows, warmup=1)}
    assert pool["adamw"]["rounds"] == 2 and pool["dion3_f1/8"]["rounds"] == 2
    assert pool["adamw"]["step_ms"] == statistics.median([100.0, 104.0, 108.0, 120.0]) == 106.0
    assert pool["dion3_f1/8"]["step_ms"] == statistics.median([101.0, 103.0, 110.0, 112.0]) == 106.5
    assert pool["adamw"]["tokens_per_s"] == pytest.approx(1000 / 0.106)
    assert pool["dion3_f1/8"]["vs_adamw"] == pytest.approx(106.0 / 106.5)
    assert pool["adamw"]["vs_adamw"] == 1.0
    assert pool["dion3_f1/8"]["tokens_per_s_each_round"] == [rows[1]["tokens_per_s"], rows[2]["tokens_per_s"]]
    assert pool["dion3_f1/8"]["optimizer_ms"] == pytest.approx(statistics.median([10.1, 10.3, 11.0, 11.2]))
    assert all(p["vs_adamw"] is None for p in bench.pooled(rows[1:3], warmup=1))
    # an lr-0 control is compared with AdamW at lr 0
    controls = [{**r, "name": r["name"] + "+lr0"} for r in (rows[0], rows[2])]
    assert {p["name"]: p["vs_adamw"] for p in bench.pooled(controls, warmup=1)} == {
        "adamw+lr0": 1.0,
        "dion3_f1/8+lr0": pytest.approx(102.0 / 111.0),
    }
    table = bench.pooled_markdown(list(pool.values()))
    assert "| dion3_f1/8 | 2 | 9390 (9804, 9009) | 106.5 | 10.65 | 99.5% |" in table
