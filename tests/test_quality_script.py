"""CPU smoke test of the issue-9 quality scripts: a tiny corpus of real text (Python's
language-reference topics), every optimizer run of scripts/quality_run.py in --tiny mode, and
the results page of scripts/plot_quality.py (their code: benchmarks/)."""

import json
import math
import os
from pathlib import Path

import pytest

from benchmarks import plot_quality, quality_corpus, quality_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("quality")
    corpus = root / "corpus"
    meta = quality_corpus.build_tiny(str(corpus))
    assert meta["train_tokens"] > 10_000 and meta["val_tokens"] > 0
    out = root / "out"
    report = quality_run.main(["--tiny", "--data", str(corpus), "--out", str(out)])
    return report, out


def test_every_run_has_finite_losses(tiny_report: tuple[dict, Path]) -> None:
    report, out = tiny_report
    with open(out / "quality.json") as f:
        saved = json.load(f)
    assert saved["runs"].keys() == report["runs"].keys()
    names = set(saved["runs"])
    expected = {
        "adamw_lr0.0005",
        "adamw_lr0.001",
        "adamw_lr0.0015",
        "muon_plain",
        "dion3_f1_standard",
        "dion3_f1_gram",
        "dion3_f0.25",
        "normuon_plain",
        "dion3n_f1_standard",
        "dion3n_f1_gram",
        "dion3n_f0.25",
        "prmuon",
    }
    assert expected <= names
    steps = saved["meta"]["args"]["steps"]
    for name, run in saved["runs"].items():
        assert run["status"] == "ok", (name, run["status"])
        losses = [v for _, v in run["val"]] + run["train"]
        assert losses and all(math.isfinite(v) for v in losses), name
        assert run["val"][0][0] == 0 and run["val"][-1][0] == steps
        assert len(run["opt_ms"]) == len(run["fwd_bwd_ms"]) == steps
        assert run["final_val"] < math.log(saved["meta"]["model"]["vocab_size"]) + 1.0
        # every run learns: AdamW's smallest lr falls by ~4e-3 in the 4 tiny steps
        assert run["final_val"] < run["val"][0][1] - 2e-3, (name, run["val"])


def test_losses_fall_as_far_as_muons(tiny_report: tuple[dict, Path]) -> None:
    """The tiny runs move little (4 steps, the loss still above the uniform prediction's), so
    compare them: every Muon-family run falls about as far as plain Muon (~2.4e-2; they end
    within 1e-3 of it), well beyond AdamW's runs, which fall further with a larger lr. (The
    tiny model's loss moves mostly through its embedding and output, which every run trains
    with AdamW: this catches a run that does not train those, not a wrong matrix update.)"""
    runs = tiny_report[0]["runs"]
    start = runs["muon_plain"]["val"][0][1]
    muon = runs["muon_plain"]["final_val"]
    assert muon < start - 1.5e-2, runs["muon_plain"]["val"]
    family = [n for n in runs if not n.startswith("adamw")]
    far = {n: runs[n]["final_val"] for n in family if abs(runs[n]["final_val"] - muon) > 3e-3}
    assert not far, (muon, far)
    adamw = [runs[f"adamw_lr{lr}"]["final_val"] for lr in ("0.0005", "0.001", "0.0015")]
    assert adamw[0] > adamw[1] > adamw[2] > muon + 5e-3, adamw


def test_same_start_for_every_run(tiny_report: tuple[dict, Path]) -> None:
    """Same init weights and validation set: the step-0 validation loss is identical."""
    first = {run["val"][0][1] for run in tiny_report[0]["runs"].values()}
    assert len(first) == 1


def test_results_page(tiny_report: tuple[dict, Path]) -> None:
    _, out = tiny_report
    page = out / "results.md"
    plot_quality.main([str(out / "quality.json"), "--no-plots", "--markdown", str(page)])
    text = page.read_text()
    assert "_not yet run_" not in text
    for name in tiny_report[0]["runs"]:
        assert f"| {name} |" in text
    # a filled page is a template too: refilling it gives the same page
    again = out / "again.md"
    plot_quality.main([str(out / "quality.json"), "--no-plots", "--markdown", str(again), "--template", str(page)])
    assert again.read_text() == text


def test_schedule_shape() -> None:
    q = quality_run
    mults = [q.lr_multiplier(s, 100, 10, 0.25, 0.0) for s in range(100)]
    assert mults[0] == pytest.approx(0.1) and mults[9] == 1.0
    assert all(m == 1.0 for m in mults[10:75])
    assert mults[-1] == pytest.approx(0.0) and all(a >= b for a, b in zip(mults[75:], mults[76:]))


@pytest.mark.skipif(not os.path.isfile(REPO / "data" / "quality" / "meta.json"), reason="data/quality not built")
def test_built_quality_corpus_fits() -> None:
    """The GPU corpus, when built here: >= 5M training tokens, 8192 ids, <= 16 MB."""
    folder = REPO / "data" / "quality"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["train_tokens"] >= 5_000_000 and meta["vocab_size"] == 8192
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 16_000_000
    assert (folder / "train.bin").stat().st_size == 2 * meta["train_tokens"]


def test_lr_sweep_names_and_merged_reports(tiny_report: tuple[dict, Path], tmp_path: Path) -> None:
    q = quality_run
    args = q.parse_args(
        ["--tiny", "--out", str(tmp_path), "--matrix-lrs", "0.01,0.04", "--runs", "muon_plain,dion3n_f0.25"]
    )
    assert [(r.name, r.lr) for r in q.default_runs(args)] == [
        ("muon_plain_lr0.01", 0.01),
        ("dion3n_f0.25_lr0.01", 0.01),
        ("muon_plain_lr0.04", 0.04),
        ("dion3n_f0.25_lr0.04", 0.04),
    ]
    assert q.default_runs(args)[1].options == {"fraction": 0.25, "flavor": "normuon"}

    # runs split over two JSONs (two GPUs) plot as one report; a run in both is refused
    _, out = tiny_report
    report = json.loads((out / "quality.json").read_text())
    names = list(report["runs"])
    halves = []
    for i, part in enumerate((names[:3], names[3:])):
        half = {"meta": {**report["meta"], "argv": [f"part{i}"]}, "runs": {n: report["runs"][n] for n in part}}
        halves.append(tmp_path / f"q{i}.json")
        halves[-1].write_text(json.dumps(half))
    plot = plot_quality
    merged = plot.load(*map(str, halves))
    assert list(merged["runs"]) == names and merged["meta"]["argv_parts"] == [["part0"], ["part1"]]
    with pytest.raises(ValueError, match="more than one JSON"):
        plot.load(str(halves[0]), str(halves[0]))


def test_momentum_and_lr_tags_and_plot_subset(tiny_report: tuple[dict, Path], tmp_path: Path) -> None:
    q = quality_run
    args = q.parse_args(
        ["--tiny", "--out", str(tmp_path), "--matrix-lrs", "0.03", "--momentum", "0.7", "--runs", "dion3_f0.25"]
    )
    assert [r.name for r in q.default_runs(args)] == ["dion3_f0.25_lr0.03_mu0.7"]
    args = q.parse_args(["--tiny", "--out", str(tmp_path), "--runs", "muon_plain"])
    assert [r.name for r in q.default_runs(args)] == ["muon_plain"]  # defaults: no tag

    # a merged report merges again with its parts' command lines kept
    _, out = tiny_report
    report = json.loads((out / "quality.json").read_text())
    names = list(report["runs"])
    parts = []
    for i, part in enumerate((names[:1], names[1:2], names[2:])):
        half = {"meta": {**report["meta"], "argv": [f"part{i}"]}, "runs": {n: report["runs"][n] for n in part}}
        parts.append(tmp_path / f"p{i}.json")
        parts[-1].write_text(json.dumps(half))
    plot = plot_quality
    first_two = tmp_path / "first_two.json"
    first_two.write_text(json.dumps(plot.load(str(parts[0]), str(parts[1]))))
    merged = plot.load(str(first_two), str(parts[2]))
    assert merged["meta"]["argv_parts"] == [["part0"], ["part1"], ["part2"]]

    pytest.importorskip("matplotlib")
    drawn = plot.plot(merged, str(tmp_path), only=[names[0]])
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in drawn)
    with pytest.raises(ValueError, match="matches no finished run"):
        plot.plot(merged, str(tmp_path), only=["no_such_run*"])
