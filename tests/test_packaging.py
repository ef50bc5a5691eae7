"""Our packaging builds without a warning (deprecated keys, license format, ...)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_builds_without_warnings(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    # pip's own notes about the machine's index configuration are not our packaging
    warned = [ln for ln in lines if "warn" in ln.lower() and "Location 'file://" not in ln]
    assert not warned, "\n".join(warned)
    assert list(tmp_path.glob("dion3_titan-*.whl"))
