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

# Measured on a GPU machine (NVIDIA H200, torch 2.11 cu13, triton 3.6, 2026-11-30;
# scripts/bench_orthogonalize.py, medians in ms, Gram NS, polar-express coefficients, fp16):
#   shape            torch   cute   triton*   gram-newton-schulz 0.1.6 (quack)
#   32x2048x7168     30.2    23.1   100.4     21.9
#   1x7168x18432     30.9    21.2   126.5     19.5
#   4x4096x11008     23.9    18.6    92.2     16.7
#   8x4096x4096      37.2    23.3   174.2     19.5   (square; plain Muon NS5 bf16: 27.3)
#   24x1024x4096      3.88    3.28   11.4      3.27
#   4x1024x11008      1.28    1.28    3.53     1.89
#   64x256x1024       0.47     -      1.00  (crossover runs: torch vs triton only)
# * the Triton symmetric GEMM as measured loaded an n-major second operand (R @ R) with scalar
#   2-byte loads; fixed since (16-byte async copies for both layouts, checked in the compiled
#   PTX) but not re-measured, so "auto" does not pick Triton until it is (docs/kernels.md).
# CuteDSL wins from n = 1024 on (ties at 4x1024x11008); below that the torch path is kept.
CUTE_MIN_N: int = 1024
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
    CuteDSL on an SM90 GPU when the Gram side min(n, m) is >= CUTE_MIN_N and a multiple of 128
    (measured faster than cuBLAS there, table above); else Triton from a Gram side of
    TRITON_MIN_N (H200, 2026-11-30, Gram NS ms torch/Triton: 64x256x1024 0.61/0.72,
    32x512x2048 0.98/0.86, 16x1024x4096 2.55/2.11, 32x2048x7168 29.0/21.7); otherwise torch.
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
    if side >= CUTE_MIN_N and side % CUTE_TILE == 0 and max(n, m) % ALIGN == 0 and cute_available():
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
