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
