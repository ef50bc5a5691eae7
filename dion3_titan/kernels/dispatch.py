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
#   32x2048x7168     27.90       19.62        21.21         31.08
#   1x7168x18432     27.23       18.61        20.46         28.48
#   4x4096x11008     24.31       14.51        16.18         22.96
#   8x4096x4096      36.22       19.95        22.29         20.63   (square: standard NS)
#   24x1024x4096      3.52        2.71         2.91          4.43
#   4x1024x11008      1.12        1.09         1.11          2.09
# Triton (its persistent TMA kernel for large batches) is the fastest or within 4% everywhere,
# so "auto" never picks CuteDSL; it stays available as backend = "cute". Below a Gram side of
# 512 torch wins eagerly (a Triton launch costs ~40 us of host time against ~16 us for a cuBLAS
# one); inside a captured step Triton is ahead there too (64x256x1024: 0.34 against 0.37 ms).
TRITON_MIN_N = 512
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


def select_backend(
    preference: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str
) -> Backend:
    """Backend for orthogonalizing a (batch, n, m) stack in ``dtype`` on ``device``.

    An explicit name is honoured as is. "auto": CPU or a dtype other than fp16/bf16 -> torch;
    Triton from a Gram side of TRITON_MIN_N; otherwise torch (measurements above).
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
    if side >= TRITON_MIN_N:
        return get_backend("triton")
    return get_backend("torch")


def select_algorithm(shape: tuple[int, int, int]) -> str:
    """"gram" | "standard" for a (batch, n, m) stack: Gram NS pays for its extra n x n work only
    when the matrix is rectangular; a square one runs standard NS. Measured at 8x4096x4096:
    standard NS on Triton 20.6 ms, Gram NS 20.0 ms (Triton) / 36.2 ms (torch), plain Muon NS5
    26.6 ms, gram-newton-schulz's standard NS with quack kernels 18.7 ms (same run)."""
    _, n, m = shape
    return "standard" if n == m else "gram"
