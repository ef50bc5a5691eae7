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

# Measured on a GPU machine (NVIDIA H200, torch 2.11 cu13, triton 3.6, 2026-11-30, one run of
# scripts/bench_orthogonalize.py; medians in ms, fp16, polar-express; docs/benchmarks.md):
#   shape            Gram torch  Gram Triton  Gram CuteDSL  standard Triton
#   32x2048x7168     29.02       21.69        22.06         33.44
#   1x7168x18432     27.44       21.50        20.52         29.79
#   4x4096x11008     22.90       16.85        16.69         24.07
#   8x4096x4096      33.84       22.40        22.82         21.82   (square: standard NS)
#   24x1024x4096      3.79        3.02         3.22          4.80
#   4x1024x11008      1.24        1.24         1.27          2.20
#   crossover (Gram NS torch / Triton): 64x256x1024 0.61/0.72, 32x512x2048 0.98/0.86
# So: torch below a Gram side of 512, Triton from 512, CuteDSL only for rectangular stacks with a
# Gram side of 4096 or more (where it was ahead); square stacks (standard NS) stay on Triton.
CUTE_MIN_N: int = 4096
CUTE_TILE: int = 128  # the CuteDSL kernel needs n % 128 == 0 (else it hands over to Triton)
# Rows/columns must be a multiple of this for the fast paths: 16-byte (8 x fp16) vector loads.
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


TRITON_MIN_N = 512


def cute_available() -> bool:
    """True when the CuteDSL backend can run here (without building it)."""
    from dion3_titan.kernels.cute_symm import is_available

    return is_available()


def select_backend(
    preference: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str
) -> Backend:
    """Backend for orthogonalizing a (batch, n, m) stack in ``dtype`` on ``device``.

    An explicit name is honoured as is. "auto": CPU or a dtype other than fp16/bf16 -> torch;
    CuteDSL on an SM90 GPU for a rectangular stack whose Gram side min(n, m) is >= CUTE_MIN_N
    and a multiple of 128; else Triton from a Gram side of TRITON_MIN_N; otherwise torch
    (measurements above).
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
    if n != m and side >= CUTE_MIN_N and side % CUTE_TILE == 0 and max(n, m) % ALIGN == 0 and cute_available():
        return get_backend("cute")
    if side >= TRITON_MIN_N:
        return get_backend("triton")
    return get_backend("torch")


def select_algorithm(shape: tuple[int, int, int]) -> str:
    """"gram" | "standard" for a (batch, n, m) stack: Gram NS pays for its extra n x n work only
    when the matrix is rectangular; a square one runs standard NS. Measured at 8x4096x4096:
    Gram NS 37.2 ms (torch) / 23.3 ms (cute) against plain Muon NS5 27.3 ms and
    gram-newton-schulz's standard NS with quack kernels 19.5 ms (table above)."""
    _, n, m = shape
    return "standard" if n == m else "gram"
