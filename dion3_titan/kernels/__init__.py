"""Kernel backends behind one interface (see backend.py)."""

from dion3_titan.kernels.dispatch import get_backend, select_backend

__all__ = ["get_backend", "select_backend"]
