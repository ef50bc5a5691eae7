"""Kernel backends behind one interface (see backend.py)."""

from dion3_titan.kernels.backend import Backend
from dion3_titan.kernels.dispatch import get_backend, resolve_algorithm, select_backend

__all__ = ["Backend", "get_backend", "resolve_algorithm", "select_backend"]
