"""Table cells and JSON files of the benchmarks."""

from __future__ import annotations

import json
import os
from pathlib import Path


def fmt(v: object, spec: str, width: int) -> str:
    """A right-aligned table cell: ``v`` formatted by ``spec``, "-" when it is not a number.
    ``spec`` "auto": 3 significant digits below 100, whole numbers above."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return f"{'-':>{width}}"
    if spec == "auto":
        spec = ".0f" if abs(v) >= 100 or v == 0 else ".3g"
    return f"{v:{width}{spec}}"


def output_path(target: str | None, name: str) -> Path | None:
    """Where a result goes: ``target`` itself when it names a .json file, else ``name`` in the
    folder ``target`` (created); $OUT when ``target`` is empty; None when neither is set."""
    target = target or os.environ.get("OUT")
    if not target:
        return None
    path = Path(target)
    if path.suffix == ".json":
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    return path / name


def write_json(path: str | Path | None, data: dict, indent: int | None = 1) -> None:
    """Write ``data`` whole or not at all (a killed command leaves the previous file)."""
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    os.replace(tmp, path)
