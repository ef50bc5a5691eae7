"""Choosing a kernel backend (and Gram vs standard NS) per shape.

``get_backend(name)`` builds one backend by name; ``select_backend("auto", ...)`` picks one per
(batch, n, m, dtype) from the measured crossovers below. Backends are stateless, so one instance
of each is cached.
"""

from __future__ import annotations

import functools

import torch

from dion3_titan.kernels.backend import Backend

BACKENDS: tuple[str, ...] = ("torch", "triton", "cute")
PREFERENCES: tuple[str, ...] = ("auto",) + BACKENDS

# Smallest Gram side n (= min(n, m) of the input) at which the Triton symmetric GEMM beats the
# cuBLAS product in the NS loop. Below it the launch and the half-empty diagonal tiles cost more
# than the saved FLOPs. Measured: see docs/kernels.md (H200, triton 3.6, torch 2.11 cu13).
TRITON_MIN_N: int = 1024
# Rows/columns must be a multiple of this for the fast path: 16-byte (8 x fp16) vector loads.
ALIGN: int = 8
_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def get_backend(name: str) -> Backend:
    """The backend called ``name``: "torch" | "triton" | "cute"."""
    if name == "torch":
        from dion3_titan.kernels.torch_ops import TorchOps

        return TorchOps()
    if name == "triton":
        from dion3_titan.kernels.triton_ops import TritonOps

        return TritonOps()
    if name == "cute":
        from dion3_titan.kernels.cute_symm import CuteOps

        return CuteOps()  # raises a clear error when CuteDSL or a Hopper GPU is missing
    raise ValueError(f"backend must be one of {BACKENDS}, got backend={name!r}")


def cute_available() -> bool:
    """True when the CuteDSL backend can run here (without building it)."""
    from dion3_titan.kernels.cute_symm import is_available

    return is_available()


def select_backend(
    preference: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str
) -> Backend:
    """Backend for orthogonalizing a (batch, n, m) stack in ``dtype`` on ``device``.

    An explicit name is honoured as is. "auto": CPU or a dtype other than fp16/bf16 -> torch;
    a Gram side below the measured crossover or not a multiple of 8 -> torch; else Triton.
    (CuteDSL is chosen only by name until it has measured wins; docs/kernels.md.)
    """
    if preference != "auto":
        if preference not in BACKENDS:
            raise ValueError(f"preference must be one of {PREFERENCES}, got preference={preference!r}")
        return get_backend(preference)
    device = torch.device(device)
    _, n, m = shape
    side = min(n, m)
    if device.type != "cuda" or dtype not in _HALF:
        return get_backend("torch")
    if side < TRITON_MIN_N or side % ALIGN != 0 or max(n, m) % ALIGN != 0:
        return get_backend("torch")
    return get_backend("triton")


def select_algorithm(shape: tuple[int, int, int]) -> str:
    """"gram" | "standard" for a (batch, n, m) stack: Gram NS pays for its extra n x n work only
    when the matrix is rectangular; a square one runs standard NS."""
    _, n, m = shape
    return "standard" if n == m else "gram"
