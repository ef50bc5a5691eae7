"""Another revision's kernel module beside the current one, for A/B timings in one process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "dion3_titan.kernels"


def load_revision(path: str, name: str) -> ModuleType:
    """The module in ``path``, a file the caller extracted (``git show REV:FILE > path``),
    imported as ``name``. Its imports of the package come from the current tree, but for the
    modules of ``PACKAGE`` whose files lie beside it under their own names (``cute_symm_sm90.py``
    beside ``cute_symm.py``): those come from the folder, so a module and the kernel it launches
    are of the same revision. The rest of the revision must be one the current tree still
    provides (for older ones, run the benchmark in their own checkout)."""
    path = Path(path)
    siblings = {}
    for file in sorted(path.parent.glob("*.py")):
        full = f"{PACKAGE}.{file.stem}"
        if file != path and importlib.util.find_spec(full) is not None:
            siblings[full] = _load(file, f"{name}_{file.stem}")
    saved = {full: sys.modules.get(full) for full in siblings}
    sys.modules.update(siblings)  # the revision's ``from PACKAGE.X import ...`` finds its own X
    try:
        return _load(path, name)
    finally:
        for full, module in saved.items():
            if module is None:
                sys.modules.pop(full)
            else:
                sys.modules[full] = module


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
