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

# Below a Gram side of TRITON_MIN_N torch wins: an eager Triton launch used to cost more host
# time than cuBLAS's. Since the launch cache (kernels/launch.py) Triton wins from 256 on both in
# a captured step (Gram NS on 32x256x2048: 0.20 ms against torch's 0.66, which mirrors every
# product's triangle in extra launches) and eager (llama3-1B shapes: 18.4 host ms per step
# against 19.8) (docs/benchmarks.md, "Backend crossover" and "Small Gram sides"). From there on,
# on a Hopper GPU with CuteDSL importable, a batch whose products run at a Gram side (padded to
# whole tiles) in [CUTE_MIN_N, CUTE_MAX_N) runs its symmetric products in CuteDSL, where its
# 128 x 128 tiles measured faster than Triton's (1024 to 2048); from 2048 on its pair tiles are
# the faster ones, on sides they cover (multiples of 256: docs/benchmarks.md, "CuteDSL pair
# tiles" and "Pair tiles from 2048 on, the mirror in 16-byte copies"). Other sides from
# CUTE_MAX_N on stay on Triton, whose wide tiles measured faster there than the 128 x 128 form.
TRITON_MIN_N = 256
CUTE_MIN_N = 1024
CUTE_MAX_N = 2816
_HALF = (torch.float16, torch.bfloat16)


def prefers_cute(side: int) -> bool:
    """Whether "auto" sends a batch whose products run at Gram side ``side`` (after the
    backend's padding) to CuteDSL when CuteDSL can run (the measured table): its 128 x 128
    or pair tiles (``cute_symm.pairs``) from CUTE_MIN_N to below CUTE_MAX_N, its pair tiles on
    larger sides."""
    from dion3_titan.kernels.cute_symm import pairs  # imports without CuteDSL

    return CUTE_MIN_N <= side < CUTE_MAX_N or pairs(side)


@functools.cache
def _cute_runs(device_index: int) -> bool:
    from dion3_titan.kernels.cute_symm import is_available

    return is_available() and torch.cuda.get_device_capability(device_index) == (9, 0)


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
    from a Gram side of TRITON_MIN_N, CuteDSL where ``prefers_cute`` and it can run, else
    Triton; otherwise torch (measurements above).
    """
    if preference != "auto":
        if preference not in BACKENDS:
            raise ValueError(f"preference must be one of {PREFERENCES}, got preference={preference!r}")
        return get_backend(preference)
    device = torch.device(device)
    _, n, m = shape
    if device.type != "cuda" or dtype not in _HALF:
        return get_backend("torch")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return get_backend(auto_choice(min(n, m), _cute_runs(index)))


def auto_choice(side: int, cute_runs: bool) -> str:
    """The backend "auto" picks for an fp16/bf16 batch of Gram side ``side`` on a CUDA GPU where
    CuteDSL runs or not: torch below TRITON_MIN_N, then CuteDSL where ``prefers_cute`` (of the
    side padded as the Triton backend pads it, which CuteDSL's backend extends), else Triton."""
    if side < TRITON_MIN_N:
        return "torch"
    return "cute" if cute_runs and prefers_cute(get_backend("triton").gram_side(side)) else "triton"


def resolve_algorithm(algorithm: str, n: int, m: int) -> str:
    """The Newton-Schulz algorithm that runs for ``algorithm`` ("gram" | "standard" | "auto") on
    an n x m matrix. "auto": Gram NS pays for its extra n x n work only when the matrix is
    rectangular, so a square one runs standard NS (docs/benchmarks.md, 8x4096x4096)."""
    if algorithm == "auto":
        return "standard" if n == m else "gram"
    return algorithm
