"""Smoke test of scripts/bench_step.py (benchmarks/step.py, + plot_step.py) on the CPU with tiny
shapes: one process, and two gloo ranks under torchrun (FSDP2). CUDA-graph rows must come back
'unavailable' on a CPU; every other row must be timed."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import plot_step
from benchmarks import step as bench
from tests.spawn import torchrun

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench_step.py"
COMMON = ["--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--strict"]
DIST_ONLY = "adamw,muon*,dion3_f1_torch*,dion3_f1/4*"

pytestmark = pytest.mark.timeout(180)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def _rows(path: Path) -> tuple[dict, dict[str, dict]]:
    data = json.loads(path.read_text())
    return data["meta"], {r["name"]: r for r in data["results"]}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """One process, in this one (no second interpreter start), one CPU thread."""
    import torch

    out = tmp_path_factory.mktemp("bench") / "single.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main([*COMMON, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return out


def test_single_process_rows(single: Path) -> None:
    meta, rows = _rows(single)
    assert meta["world"] == 1 and meta["model"] == "tiny" and meta["complete"]
    expected = {
        "adamw",
        "muon_torch",
        "muon",
        "dion3_f1_torch",
        "dion3_f1_torch_nomb",
        "dion3_f1_kernels",
        "dion3_f1_gram",
        "dion3_f1/2",
        "dion3_f1/4",
    }
    graph_rows = {n + "+graph" for n in expected if n.startswith("dion3") and n != "dion3_f1_torch_nomb"}
    norm_rows = {"dion3_f1_gram+graph+norm", "dion3_f1/4+graph+norm", "dion3_f1/4+graph+norm+1stream"}
    assert expected | graph_rows | norm_rows == set(rows)
    for r in rows.values():
        if r["graph"]:
            assert r["status"] == "unavailable", r
            continue
        assert r["status"] == "ok", r
        assert r["gpu_ms"] > 0 and r["host_ms"] > 0 and len(r["gpu_ms_all"]) == 2
        assert r["comm_mb"] == 0  # one process moves nothing
    assert rows["muon"]["x_muon"] == pytest.approx(1.0)
    assert rows["adamw"]["ns_tflop"] == 0 and rows["adamw"]["floor_ms"] > 0  # memory floor
    # FLOPs: plain NS5 on every matrix for both Muon rows; Gram counts less; f shrinks it.
    assert rows["muon"]["ns_tflop"] == pytest.approx(rows["muon_torch"]["ns_tflop"])
    f1, half, quarter = (rows[n]["ns_tflop"] for n in ("dion3_f1_gram", "dion3_f1/2", "dion3_f1/4"))
    assert 0 < quarter < half < f1 < rows["muon"]["ns_tflop"]


def test_plot_markdown(single: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot_step.main([str(single), "--markdown"])
    text = capsys.readouterr().out
    assert "| Configuration |" in text and "| unavailable |" in text and "CUDA graphs need a GPU" in text
    assert text.count("\n| ") >= 15  # header + 14 configurations


def test_plot_png(single: Path) -> None:
    pytest.importorskip("matplotlib")
    png = single.with_suffix(".png")
    plot_step.main([str(single), "-o", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_gloo_ranks_fsdp2(tmp_path: Path) -> None:
    out = tmp_path / "dist.json"
    _run(torchrun(2, str(BENCH), *COMMON, "--only", DIST_ONLY, "--out", str(out)))
    meta, rows = _rows(out)
    assert meta["world"] == 2 and meta["fsdp2"]
    assert rows["muon_torch"]["status"] == "unavailable"  # no DTensor support
    for name in ("adamw", "muon", "dion3_f1_torch", "dion3_f1_torch_nomb", "dion3_f1/4"):
        assert rows[name]["status"] == "ok", rows[name]
    assert rows["adamw"]["comm_mb"] == 0
    full, quarter = rows["dion3_f1_torch"]["comm_mb"], rows["dion3_f1/4"]["comm_mb"]
    assert full > 0 and 0 < quarter < full / 2  # shards move, f = 1/4 moves about a quarter
    assert rows["dion3_f1_torch_nomb"]["comm_mb"] == pytest.approx(full)


def test_flop_formulas() -> None:
    """The per-matrix counts quoted in the paper (Sec. 2.2, 2.3) and DESIGN.md (the package's
    FLOP model, which bench_step and the megabatch plan use)."""
    from dion3_titan.kernels import flops

    n, m = 1024, 4096
    assert flops.gram_ns_flops(n, m, 5, (2,), symmetric=True) == 14 * n**3 + 6 * n**2 * m
    assert flops.standard_ns_flops(n, m, 5, symmetric=False) == 5 * (4 * m * n**2 + 2 * n**3)
    assert flops.standard_ns_flops(n, m, 5, symmetric=True) == 5 * (3 * m * n**2 + n**3)
    assert flops.ns_flops(m, n, "auto", 5, (2,), True) == flops.gram_ns_flops(n, m, 5, (2,), True)  # tall = wide
    assert flops.ns_flops(n, n, "auto", 5, (2,), True) == flops.standard_ns_flops(n, n, 5, True)  # square


def test_graph_rows_with_a_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph-row path (warm-up, timing, release) with an eager stand-in for
    GraphedOptimizer, since a CPU cannot capture."""
    import torch

    released: list[bool] = []

    class StandIn:
        def __init__(self, optimizer, warmup_steps: int = 3) -> None:
            self.optimizer, self.warmup_steps = optimizer, warmup_steps

        def step(self) -> None:
            self.optimizer.step()

        def use_gradient_norm(self, norm) -> None:
            self.optimizer.use_gradient_norm(norm)

        def release(self) -> None:  # which flag source the steps took
            released.append(self.optimizer.nonfinite.flag_sources)

    monkeypatch.setattr(bench, "graphed_optimizer_class", lambda: (StandIn, ""))
    monkeypatch.setattr(bench, "unavailable_reason", lambda cfg, device, note: "")
    out = tmp_path / "graph.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main([*COMMON, "--only", "dion3_f1/4*", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    _, rows = _rows(out)
    for name in ("dion3_f1/4+graph", "dion3_f1/4+graph+norm", "dion3_f1/4+graph+norm+1stream"):
        assert rows[name]["status"] == "ok" and rows[name]["gpu_ms"] > 0
    # in run order: the row without a norm made its own pass every step, the others never did
    assert [s["gradient_norm"] > 0 for s in released] == [False, True, True], released
    assert [s["own_pass"] > 0 for s in released] == [True, False, False], released


@pytest.mark.parametrize("name", ["1b", "tiny"])
def test_llama3_shapes_are_torchtitans(name: str) -> None:
    """The shapes bench_step derives from bench_train's llama3 arguments are the parameter
    names and shapes torchtitan's llama3 builds from them (on the meta device: no memory)."""
    import torch
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    from benchmarks.llama import LLAMA3_ARGS, LlamaParams, llama3_shape

    vocab = 8192 if name == "1b" else 512
    shape = llama3_shape(LLAMA3_ARGS[name], vocab)
    with torch.device("meta"):
        ours = {n: tuple(p.shape) for n, p in LlamaParams(shape).named_parameters()}
        titan = Transformer(TransformerModelArgs(**LLAMA3_ARGS[name], vocab_size=vocab))
        theirs = {n: tuple(p.shape) for n, p in titan.named_parameters()}
    assert ours == theirs


def test_model_1b_train_is_bench_trains_model() -> None:
    """--model 1b_train: bench_train's 1b (dim 2048, 16 layers, 16 heads / 8 KV heads, SwiGLU
    hidden 8192) with the vocabulary of the large corpus bench_train trains on (8192)."""
    from benchmarks.llama import ModelShape, count_params

    name, shape, notes = bench.model_shape(bench.parse_args(["--model", "1b_train"]))
    assert name == "1b_train" and not notes
    assert shape == ModelShape(hidden=2048, layers=16, heads=16, kv_heads=8, mlp_hidden=8192, vocab=8192)
    assert 1.0e9 < count_params(shape) < 1.1e9


def test_settings_rows_run_under_their_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--settings: each of our Dion3 rows runs again right after itself with the module
    attributes set (seen from inside the run), which are restored afterwards; the variant row
    keeps its row's anchor pairing and lists its settings."""
    import torch

    from dion3_titan.kernels import cute_symm, dispatch

    seen: list[tuple[str, int, int]] = []
    real = bench.run_config

    def spy(cfg, *args, **kwargs):
        seen.append((cfg.name, cute_symm.GENERAL, dispatch.CUTE_MIN_N))
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(bench, "run_config", spy)
    general, cute_min = cute_symm.GENERAL, dispatch.CUTE_MIN_N
    out = tmp_path / "settings.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(
            [
                *COMMON,
                "--only",
                "adamw,dion3_f1/4",
                "--settings",
                "cute_symm.GENERAL=7+dispatch.CUTE_MIN_N=3,cute_symm.GENERAL=5",
                "--out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    variant = "dion3_f1/4[cute_symm.GENERAL=7+dispatch.CUTE_MIN_N=3]"
    assert seen == [
        ("adamw", general, cute_min),
        ("dion3_f1/4", general, cute_min),
        (variant, 7, 3),
        ("dion3_f1/4[cute_symm.GENERAL=5]", 5, cute_min),
    ]
    assert (cute_symm.GENERAL, dispatch.CUTE_MIN_N) == (general, cute_min)
    _, rows = _rows(out)
    assert rows[variant]["status"] == "ok" and rows[variant]["gpu_ms"] > 0
    assert rows[variant]["settings"] == [
        "dion3_titan.kernels.cute_symm.GENERAL=7",
        "dion3_titan.kernels.dispatch.CUTE_MIN_N=3",
    ]
    assert rows["dion3_f1/4"]["settings"] == []
    from benchmarks.step_configs import anchor_of

    assert anchor_of(variant, "normuon") == anchor_of("dion3_f1/4", "normuon") == "dion_f1/4"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cute_symm.GENERALX=0", "has no attribute 'GENERALX'"),
        ("no_such_module.X=1", "no module 'no_such_module'"),
        ("cute_symm.GENERAL", "is not MODULE.ATTRIBUTE=VALUE"),
        ("cute_symm.GENERAL=on", "is not a Python literal"),
    ],
)
def test_bad_settings_stop_before_any_step(spec: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        bench.main([*COMMON, "--only", "adamw", "--settings", spec])
