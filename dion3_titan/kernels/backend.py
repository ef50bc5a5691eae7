"""The interface every kernel backend implements (torch, Triton, CuteDSL).

Orthogonalization and the weight update are written against these five ops only, so a backend
is chosen per shape without touching the algorithms.
"""

import functools
import os

import torch


@functools.cache
def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1): then they also
    take CPU tensors. Read once per process, as Triton itself does when it decorates a kernel
    (it is asked at every launch)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class Backend:
    """Batched ops on (L, n, k) operands. Results are new tensors unless stated."""

    name: str = "abstract"

    def gram_side(self, n: int) -> int:
        """The side at which this backend orthogonalizes a batch whose Gram side is n: zero
        rows added up to it change nothing (they stay zero through Newton-Schulz) and let the
        backend's kernels take their fastest form."""
        return n

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b."""
        raise NotImplementedError

    def mm_add(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        """alpha * (a @ b) + beta * c."""
        raise NotImplementedError

    def sym_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b where the caller guarantees the product is symmetric (e.g. X @ X^T)."""
        raise NotImplementedError

    def sym_addmm(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        """alpha * (a @ b) + beta * c where the result is symmetric (c symmetric too)."""
        raise NotImplementedError

    def fused_update(
        self,
        weight: torch.Tensor,
        update: torch.Tensor,
        rows: torch.Tensor,
        lr: torch.Tensor,
        decay: torch.Tensor,
    ) -> None:
        """In place on ``weight`` (B, R, C), possibly a strided view: every row is multiplied
        by ``decay`` and rows ``rows`` (B, k) get ``- lr * update`` (update is (B, k, C)),
        in float32 with a single rounding to weight's dtype. ``lr`` and ``decay`` are 0-dim
        float32 tensors on weight's device (kept live under CUDA-graph replay)."""
        raise NotImplementedError
