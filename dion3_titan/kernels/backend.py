"""The interface every kernel backend implements (torch, Triton, CuteDSL).

Orthogonalization and the weight update are written against these six ops only, so a backend
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


def norm_denominator(x: torch.Tensor, eps: float) -> torch.Tensor:
    """||x||_F + eps per matrix of a batch (B, n, m), shaped (B, 1, 1): in float32 (float64 for
    float64 x), so the scale is exact before the one rounding of x divided by it."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=acc) + eps


def divide_by_norm(x: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """out <- x / (||x||_F + eps) per matrix, rounded once to out's dtype (one pass, no
    float32 copy of x); out may be a view of a larger buffer."""
    return torch.div(x, norm_denominator(x, eps), out=out)


def normalized_buffer(x: torch.Tensor, dtype: torch.dtype, side: int) -> torch.Tensor:
    """The (B, side, m) result of ``Backend.normalize``: x's memory order where no rows are
    added (a transposed view stays one), else contiguous."""
    if side == x.shape[-2]:
        return torch.empty_like(x, dtype=dtype)
    return torch.empty((x.shape[0], side, x.shape[-1]), dtype=dtype, device=x.device)


class Backend:
    """Batched ops on (L, n, k) operands. Results are new tensors unless stated; the general
    products also write into ``out`` where given (a contiguous tensor of the result's shape and
    dtype: Newton-Schulz's halves put their results into one batch that way)."""

    name: str = "abstract"

    def normalize(self, x: torch.Tensor, eps: float, dtype: torch.dtype, side: int) -> torch.Tensor:
        """Newton-Schulz's input: x (B, n, m) / (||x||_F + eps) per matrix, rounded once to
        ``dtype``, with zero rows appended up to ``side`` (>= n) rows."""
        n = x.shape[-2]
        out = normalized_buffer(x, dtype, side)
        divide_by_norm(x, eps, out[:, :n])
        out[:, n:].zero_()
        return out

    def gram_side(self, n: int) -> int:
        """The side at which this backend orthogonalizes a batch whose Gram side is n: zero
        rows added up to it change nothing (they stay zero through Newton-Schulz) and let the
        backend's kernels take their fastest form."""
        return n

    def gram_depth(self, n: int) -> int:
        """How far along the Gram side (``gram_side(n)``) Newton-Schulz's products over it read
        their operands: the zero rows past n add nothing to them, so a backend whose kernels
        take a shorter inner dimension as fast skips them. At least n; here the whole side."""
        return self.gram_side(n)

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """a @ b."""
        raise NotImplementedError

    def mm_add(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        alpha: float,
        beta: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """alpha * (a @ b) + beta * c."""
        raise NotImplementedError

    def mm_checked(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor | None,
        alpha: float,
        beta: float,
        flags: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """alpha * (a @ b) (+ beta * c where c is given), whose kernel also sets ``flags[i]`` (an
        (L,) int32 tensor) to 1 for each matrix i of the result holding a NaN or inf, in its
        epilogue: no pass over the result. None where this backend has no such kernel for these
        operands (the caller then makes the product unchecked)."""
        return None

    def sym_mm(self, a: torch.Tensor, b: torch.Tensor, zero_from: int | None = None) -> torch.Tensor:
        """a @ b where the caller guarantees the product is symmetric (e.g. X @ X^T).
        ``zero_from``: a's rows from there on are zero (also the caller's guarantee: the padding
        of a Gram side), so a backend may leave their products out."""
        raise NotImplementedError

    def sym_addmm(
        self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float, zero_from: int | None = None
    ) -> torch.Tensor:
        """alpha * (a @ b) + beta * c where the result is symmetric (c symmetric too);
        ``zero_from`` as in ``sym_mm``."""
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
