"""Another revision's kernel module beside the current one, for A/B timings in one process."""

from __future__ import annotations

import importlib.util
from types import ModuleType


def load_revision(path: str, name: str) -> ModuleType:
    """The module in ``path``, a file the caller extracted (``git show REV:FILE > path``),
    imported as ``name``. It imports the rest of the package from the current tree, so the
    revision must be one whose imports that tree still provides (for older ones, run the
    benchmark in their own checkout)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
