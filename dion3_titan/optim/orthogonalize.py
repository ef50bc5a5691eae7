"""Newton-Schulz orthogonalization: stabilized Gram NS (paper Alg. 3) and standard NS (Alg. 1).

Both take a batch X of shape (B, n, m) in either orientation and return approximately
polar(X) = U V^T with the same shape, in the compute dtype. Every matrix product goes through
a ``Backend`` so the same code runs on torch, Triton or CuteDSL kernels.
"""

from dataclasses import dataclass

import torch

from dion3_titan.kernels.backend import Backend, divide_by_norm
from dion3_titan.kernels.dispatch import resolve_algorithm
from dion3_titan.optim.config import Coefficients, Dion3Config


@dataclass(frozen=True)
class NSSettings:
    algorithm: str  # "gram" | "standard" | "auto"
    coefficients: Coefficients
    restarts: tuple[int, ...] = (2,)
    dtype: torch.dtype = torch.float16
    eps: float = 1e-7

    @classmethod
    def from_config(cls, cfg: Dion3Config) -> "NSSettings":
        """The Newton-Schulz settings of a param group's config."""
        return cls(cfg.ns_algorithm, cfg.coefficients(), cfg.ns_restarts, cfg.compute_dtype, cfg.ns_eps)


@dataclass
class ResultCheck:
    """Asks Newton-Schulz's last product to flag, in its epilogue, the matrices whose result
    holds a NaN or inf (``Backend.mm_checked``), so no pass over the result is needed to know.
    ``bad`` is then (B,) bool; it stays None where the backend has no such kernel for the
    product (the caller checks the result itself)."""

    bad: torch.Tensor | None = None


def _product(
    ops: Backend,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    alpha: float,
    beta: float,
    check: ResultCheck | None,
) -> torch.Tensor:
    """alpha * (a @ b) (+ beta * c), through the backend's checked product where asked and it
    has one."""
    if check is not None:
        flags = torch.zeros(a.shape[0], dtype=torch.int32, device=a.device)
        out = ops.mm_checked(a, b, c, alpha, beta, flags)
        if out is not None:
            check.bad = flags != 0
            return out
    return ops.mm(a, b) if c is None else ops.mm_add(a, b, c, alpha, beta)


def is_transposed_batch(views: list[torch.Tensor]) -> bool:
    """True when every (B, n, m) view is the transpose of a contiguous tensor (a view that
    selects a weight's columns): batches built from them should keep that memory order."""
    return all(not v.is_contiguous() and v.mT.is_contiguous() for v in views)


def normalize_batch(views: list[torch.Tensor], eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The views (B_i, n, m), each matrix normalized as ``orthogonalize`` does it, batched as
    one (sum B_i, n, m) tensor in ``dtype``: each view is read once for its norms and once by
    the division that writes its slice of the batch (no float32 concatenation)."""
    n, m = views[0].shape[-2:]
    total = sum(v.shape[0] for v in views)
    device = views[0].device
    if is_transposed_batch(views):
        out = torch.empty((total, m, n), dtype=dtype, device=device).mT
    else:
        out = torch.empty((total, n, m), dtype=dtype, device=device)
    start = 0
    for v in views:
        divide_by_norm(v, eps, out[start : start + v.shape[0]])
        start += v.shape[0]
    return out


def gram_newton_schulz(
    x: torch.Tensor,
    coefficients: Coefficients,
    restarts: tuple[int, ...],
    backend: Backend,
    column_major: bool = False,
    check: ResultCheck | None = None,
) -> torch.Tensor:
    """Alg. 3 on a wide, normalized x (B, n, m), n <= m.

    Iterates on the n x n Gram matrix R: Z = b R + c R^2, Q <- Q Z + a Q,
    R <- Z (R Z + a R) + a (R Z + a R). The a_t I term is never added inside a product (App.
    B.2.3): it stays in the fp32 epilogue as "+ a * (previous matrix)". At each restart
    iteration X <- Q X and R, Q are rebuilt, which clears spurious negative eigenvalues.
    ``column_major``: the result is the transpose view of X^T Q (= (Q X)^T, Q symmetric), the
    memory order of a tall caller's rows, so the passes after NS read it row by row.
    ``check``: the last product flags the matrices whose result is not finite (``ResultCheck``).
    """
    ops = backend
    xt = x.mT
    r = ops.sym_mm(x, xt)
    q: torch.Tensor | None = None  # None stands for the identity
    steps = len(coefficients)
    for t, (a, b, c) in enumerate(coefficients):
        if t > 0 and t in restarts:
            if q is not None:
                x = ops.mm(q, x)
                xt = x.mT
            r = ops.sym_mm(x, xt)
            q = None
        z = ops.sym_addmm(r, r, r, alpha=c, beta=b)
        # R is needed only by a later iteration that does not restart.
        if t + 1 < steps and (t + 1) not in restarts:
            rz = ops.sym_addmm(r, z, r, alpha=1.0, beta=a)
            r = ops.sym_addmm(z, rz, rz, alpha=1.0, beta=a)
        if q is None:  # Q = Z + a I, in Z's memory: nothing reads Z after this
            q = z
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = ops.sym_addmm(q, z, q, alpha=1.0, beta=a)
    if q is None:
        return x
    if column_major:
        return _product(ops, x.mT, q, None, 1.0, 0.0, check).mT
    return _product(ops, q, x, None, 1.0, 0.0, check)


def standard_newton_schulz(
    x: torch.Tensor, coefficients: Coefficients, backend: Backend, check: ResultCheck | None = None
) -> torch.Tensor:
    """Alg. 1 on a wide, normalized x: A = X X^T, B = b A + c A^2, X <- a X + B X. ``check``:
    as in ``gram_newton_schulz``."""
    ops = backend
    last = len(coefficients) - 1
    for t, (a, b, c) in enumerate(coefficients):
        gram = ops.sym_mm(x, x.mT)
        poly = ops.sym_addmm(gram, gram, gram, alpha=c, beta=b)
        x = _product(ops, poly, x, x, 1.0, a, check if t == last else None)
    return x


def orthogonalize(
    x: torch.Tensor,
    settings: NSSettings,
    backend: Backend,
    tall: bool | None = None,
    normalized: bool = False,
    check: ResultCheck | None = None,
) -> torch.Tensor:
    """polar(x) for a batch x (B, n, m) of either orientation; result in ``settings.dtype``.

    A tall input is processed as its transpose (a view, no copy) and transposed back.
    ``tall`` overrides the orientation when x carries zero padding: the Gram matrix must be
    formed on the side of the real (unpadded) shape that is smaller, or its null space holds
    rounding noise that the iteration amplifies; zero rows or columns stay exactly zero.
    ``normalized``: x is already ``normalize_batch``'s output (scaled, in the compute dtype).
    A Gram side the backend prefers larger (``Backend.gram_side``) is zero-padded here; a
    caller that packs its batch at that side already avoids the copy. ``check``: the last
    product flags the matrices whose result is not finite, where the backend can (``ResultCheck``).
    """
    if x.ndim != 3:
        raise ValueError(f"orthogonalize expects a (B, n, m) batch, got shape {tuple(x.shape)}")
    if tall is None:
        tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    n, m = x.shape[-2:]
    algorithm = resolve_algorithm(settings.algorithm, n, m)  # of the real shape, before padding
    side = backend.gram_side(n)  # zero rows stay zero: the result's first n rows are unchanged
    if not normalized:
        xn = backend.normalize(x, settings.eps, settings.dtype, side)
    elif side > n:
        xn = torch.nn.functional.pad(x, (0, 0, 0, side - n))
    else:
        xn = x
    if algorithm == "gram":
        out = gram_newton_schulz(xn, settings.coefficients, settings.restarts, backend, tall, check)
    else:
        out = standard_newton_schulz(xn, settings.coefficients, backend, check)
    out = out[:, :n]
    return out.mT if tall else out
