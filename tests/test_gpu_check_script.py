"""scripts/gpu_check.sh, the GPU checks of the headline numbers, can only run on a GPU: here its
parts are checked to name rows and options the benchmarks know, so a renamed row or flag fails
in CI instead of in a GPU run. An unknown part is refused with one line naming the parts."""

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import step as bench_step
from benchmarks import step_configs, train_throughput

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses_and_refuses_an_unknown_part(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    env = {"PYTHON": "false", "OUT": str(tmp_path)}  # nothing runs before the unknown part
    proc = subprocess.run(["bash", str(SCRIPT), "nope", "tests"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "unknown part 'nope'; the parts are: tests step ns host train dist" in proc.stderr


def test_step_rows_are_rows_bench_step_builds(monkeypatch):
    """Each ``step_rows`` line's rows: every pattern matches a row of its flavor (the anchors'
    rows as bench_step names them when microsoft/dion imports)."""
    monkeypatch.setattr(step_configs, "anchor_module", lambda: (object(), "stand-in"))
    lines = re.findall(r'step_rows (\S+) (\S+) (\S+) "([^"]+)"', SCRIPT.read_text())
    assert len(lines) == 4
    # the dist part's rows: the 7b model with NorMuon, under torchrun
    lines += [
        ("7b", "8", "normuon", only) for only in re.findall(r'for only in "([^"]+)" "([^"]+)"', SCRIPT.read_text())[0]
    ]
    for model, layers, flavor, only in lines:
        args = bench_step.parse_args(["--model", model, "--layers", layers, "--flavor", flavor, "--only", only])
        names = {c.name for c in step_configs.build_configs(args)}
        for pattern in only.split(","):
            assert pattern in names, (flavor, pattern, sorted(names))


def test_train_runs_are_runs_bench_train_knows():
    (only,) = re.findall(r"bench_train\.py --only (\S+)", SCRIPT.read_text())
    assert [r.name for r in train_throughput.selected_runs(only)] == only.split(",")


@pytest.mark.parametrize("script", sorted(set(re.findall(r"scripts/\w+\.py", SCRIPT.read_text()))))
def test_every_script_it_runs_exists(script):
    assert (ROOT / script).is_file()


def test_settings_name_module_attributes_that_exist():
    found = re.findall(r'--settings "([^"]+)"', SCRIPT.read_text())
    assert found
    for spec in found:
        for variant in spec.split(","):
            for part in variant.split("+"):
                step_configs.parse_setting(part)  # one clear ValueError for a renamed switch


def test_ns_switches_are_ones_the_benchmarks_know():
    """The ns part's A/B switches: bench_orthogonalize's --variants and bench_sym_ab's
    --cute-variants (NAME=value settings of kernels/cute_symm.py)."""
    from benchmarks import orthogonalize as bench_orthogonalize
    from dion3_titan.kernels import cute_symm

    text = SCRIPT.read_text()
    (variants,) = re.findall(r"bench_orthogonalize\.py .*?--variants (\S+)", text, re.S)
    assert set(variants.split(",")) <= set(bench_orthogonalize.VARIANTS), variants
    (cute_variants,) = re.findall(r"--cute-variants (\S+)", text)
    for setting in cute_variants.split(","):
        for part in setting.split("+"):
            name, value = part.split("=")
            assert hasattr(cute_symm, name), part
            int(value)  # bench_sym_ab reads the values as integers
