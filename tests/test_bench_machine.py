"""The card state the benchmarks record beside their timings (benchmarks/machine.py), through a
stand-in nvidia-smi on PATH: what it prints is parsed, a failing or missing one gives None."""

import os
import stat

import pytest

from benchmarks.machine import CARD_FIELDS, card_state, parse_card_state


def test_a_query_line_becomes_numbers_and_unreported_fields_none():
    assert parse_card_state("1980, 612.45, 51") == {"sm_mhz": 1980.0, "power_w": 612.45, "temp_c": 51.0}
    assert parse_card_state("1755, [N/A], 48") == {"sm_mhz": 1755.0, "power_w": None, "temp_c": 48.0}
    assert parse_card_state("1980, 612.45") is None
    assert parse_card_state("") is None


def _fake_smi(tmp_path, body: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(tmp_path)


@pytest.mark.parametrize(
    "body, want",
    [
        (
            'echo "$@" > "$(dirname "$0")/args"; echo "1410, 698.10, 63"',
            {"sm_mhz": 1410.0, "power_w": 698.1, "temp_c": 63.0},
        ),
        ('echo "Failed to initialize NVML" >&2; exit 9', None),
        ('echo "not, a, number, line"', None),
    ],
    ids=["answers", "fails", "garbled"],
)
def test_card_state_asks_nvidia_smi_for_its_fields_of_one_card(tmp_path, monkeypatch, body, want):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, body) + os.pathsep + os.environ.get("PATH", ""))
    assert card_state(3) == want
    if want is not None:
        args = (tmp_path / "args").read_text().split()
        assert f"--query-gpu={','.join(CARD_FIELDS)}" in args
        assert args[args.index("-i") + 1] == "3"


def test_no_nvidia_smi_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi anywhere
    assert card_state() is None
