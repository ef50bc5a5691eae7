"""Optimizer metrics reach torchtitan's logger at metrics.log_freq during real training
(torchrun, 2 gloo ranks, llama3 debug), and are finite and plausible."""

import math
import re

import pytest

from tests.titan_helpers import CONFIGS, run_titans

pytestmark = pytest.mark.timeout(600)

LINE = re.compile(r"\[dion3\] step\s+(\d+) (.*)")


def _metrics(output: str) -> dict[int, dict[str, float]]:
    out = {}
    for m in LINE.finditer(output):
        out[int(m.group(1))] = {k: float(v) for k, v in (kv.split("=") for kv in m.group(2).split())}
    return out


def test_optimizer_metrics_logged(tmp_path):
    args = ("--training.steps", "4", "--metrics.log_freq", "2", "--validation.no-enable")
    launch = run_titans(
        {
            fraction: (
                CONFIGS / "llama3_debug_dion3.toml",
                tmp_path / fraction,
                (*args, "--optimizer.fraction", fraction, "--optimizer.optimizer_metrics", "True"),
            )
            for fraction in ("0.25", "1.0")
        }
    )  # both in turn in one launch
    runs = {}
    for fraction, run in launch.items():
        assert run.returncode == 0, run.report()
        runs[fraction] = _metrics(run.output)
    quarter, full = runs["0.25"], runs["1.0"]
    assert sorted(quarter) == [1, 2, 4], quarter.keys()  # torchtitan logs step 1 and every log_freq
    for step, m in quarter.items():
        for key in (
            "host_ms",
            "comm_MB",
            "collectives",
            "update_rms/attention",
            "update_rms/mlp",
            "update_rms/adamw",
            "selection/covered",
            "selection/oldest_unselected",
            "ns_nonfinite",
        ):
            assert key in m and math.isfinite(m[key]), (step, key, m)
        assert m["comm_MB"] > 0 and m["collectives"] > 0 and m["ns_nonfinite"] == 0
        assert 0 < m["update_rms/mlp"] < 1
    # rows selected at least once grow with steps; f = 1 selects every row every step
    assert quarter[4]["selection/covered"] > quarter[1]["selection/covered"]
    assert full[4]["selection/covered"] == 1.0 and full[4]["selection/oldest_unselected"] == 0
    ratio = quarter[4]["comm_MB"] / full[4]["comm_MB"]
    assert 0.22 < ratio < 0.3, ratio
