"""What a result was measured on: the checkout it ran from, its commit, and the device's name.
No torch import at the top: the plotting scripts use ROOT without it."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository's root


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return platform.processor() or "cpu"
    import torch

    return torch.cuda.get_device_name(device)


def git_commit() -> str | None:
    """HEAD of the checkout, "+dirty" when it has uncommitted changes; None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# What the card ran at, read (never set) through nvidia-smi: the SM clock, the board power and
# the temperature. Kernels that keep the tensor cores busier may meet the power cap sooner,
# which shows as a lower clock in back-to-back timing than in a single call. (Fields that every
# driver has; the clock-limit reasons were renamed across drivers, and one unknown field fails
# the whole query.)
CARD_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
CARD_KEYS = ("sm_mhz", "power_w", "temp_c")


def parse_card_state(line: str) -> dict | None:
    """One ``nvidia-smi --query-gpu=CARD_FIELDS --format=csv,noheader,nounits`` line as a dict
    of floats (a field the card does not report as None); None when the line does not have the
    fields."""
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(CARD_FIELDS):
        return None
    state: dict = {}
    for key, value in zip(CARD_KEYS, values):
        try:
            state[key] = float(value)
        except ValueError:  # "[N/A]", "[Not Supported]"
            state[key] = None
    return state


def card_state(index: int = 0) -> dict | None:
    """Card ``index``'s state now (``parse_card_state``), None where nvidia-smi is absent or
    fails. ``index`` in nvidia-smi's numbering (torch's too unless CUDA_VISIBLE_DEVICES reorders
    the cards). Takes tens of milliseconds of host time: call it between timings, not inside one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(CARD_FIELDS)}", "--format=csv,noheader,nounits", "-i", str(index)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_card_state(out.stdout.strip().splitlines()[0]) if out.returncode == 0 and out.stdout.strip() else None
