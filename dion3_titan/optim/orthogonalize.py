"""Newton-Schulz orthogonalization: stabilized Gram NS (paper Alg. 3) and standard NS (Alg. 1).

Both take a batch X of shape (B, n, m) in either orientation and return approximately
polar(X) = U V^T with the same shape, in the compute dtype. Every matrix product goes through
a ``Backend`` so the same code runs on torch, Triton or CuteDSL kernels.

A large batch runs as two halves, each on a CUDA stream of its own (``in_halves``). Each
product's persistent kernel ends in a last wave of tiles that leaves most SMs idle (32 x 2048^2:
the general product's 2048 pair tiles are 31.03 waves of the 66 clusters of an H100 or H200,
and 33 matrices took as long as 32); beside the other half's products those SMs find work. The
matrices are computed by the same kernels either way: the results are bit-identical.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dion3_titan.kernels.backend import Backend, divide_by_norm
from dion3_titan.kernels.dispatch import resolve_algorithm
from dion3_titan.kernels.tma import grid_sms, num_sms
from dion3_titan.optim.config import Coefficients, Dion3Config

# A batch runs in halves where a half's X X^T still takes this many FLOPs (about 0.2 ms on an
# H100 or H200), so that the launches the halves add stay hidden behind the GPU's work.
# Newton-Schulz alone, halves against one batch in alternating rounds: one H100 32 x 2048^2 9.69
# vs 9.87 ms, 16 x 2752 x 4096 13.79 vs 14.42; one H200 level within the rounds' spread (10.10
# vs 10.06, 14.43 vs 14.29), its 7b Muon step at f = 1 129.8 vs 130.6 ms (docs/benchmarks.md,
# "Newton-Schulz in halves on two streams").
HALVES_MIN_FLOPS = 1e11


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """alpha * (a @ b) (+ beta * c), through the backend's checked product where asked and it
    has one; into ``out`` where given."""
    if check is not None:
        flags = torch.zeros(a.shape[0], dtype=torch.int32, device=a.device)
        result = ops.mm_checked(a, b, c, alpha, beta, flags, out)
        if result is not None:
            check.bad = flags != 0
            return result
    return ops.mm(a, b, out) if c is None else ops.mm_add(a, b, c, alpha, beta, out)


def _inner(a: torch.Tensor, b: torch.Tensor, depth: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of a @ b over a Gram side, read up to ``depth`` along it (views): the rows
    of a padded side past ``depth`` are zero, so their terms add nothing (``Backend.gram_depth``)."""
    if depth is None or depth >= a.shape[-1]:
        return a, b
    return a[..., :depth], b[:, :depth]


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
    out: torch.Tensor | None = None,
    depth: int | None = None,
) -> torch.Tensor:
    """Alg. 3 on a wide, normalized x (B, n, m), n <= m.

    Iterates on the n x n Gram matrix R: Z = b R + c R^2, Q <- Q Z + a Q,
    R <- Z (R Z + a R) + a (R Z + a R). The a_t I term is never added inside a product (App.
    B.2.3): it stays in the fp32 epilogue as "+ a * (previous matrix)". At each restart
    iteration X <- Q X and R, Q are rebuilt, which clears spurious negative eigenvalues.
    ``column_major``: the result is the transpose view of X^T Q (= (Q X)^T, Q symmetric), the
    memory order of a tall caller's rows, so the passes after NS read it row by row.
    ``check``: the last product flags the matrices whose result is not finite (``ResultCheck``).
    ``out``: where the last product writes the result (of its shape and memory order).
    ``depth``: x's rows from there on are zero padding; the products over the Gram side
    (all but X X^T) read their operands only up to it (Q's padded block is a I, but the
    operand it meets there, Z or X, is zero), and every symmetric product names it as the first
    zero row of its A (``zero_from``: within what a product reads, Q's a I lies past it too).
    """
    ops = backend
    xt = x.mT
    r = ops.sym_mm(x, xt, zero_from=depth)
    q: torch.Tensor | None = None  # None stands for the identity
    steps = len(coefficients)
    for t, (a, b, c) in enumerate(coefficients):
        if t > 0 and t in restarts:
            if q is not None:
                x = ops.mm(*_inner(q, x, depth))
                xt = x.mT
            r = ops.sym_mm(x, xt, zero_from=depth)
            q = None
        z = ops.sym_addmm(*_inner(r, r, depth), r, alpha=c, beta=b, zero_from=depth)
        # R is needed only by a later iteration that does not restart.
        if t + 1 < steps and (t + 1) not in restarts:
            rz = ops.sym_addmm(*_inner(r, z, depth), r, alpha=1.0, beta=a, zero_from=depth)
            r = ops.sym_addmm(*_inner(z, rz, depth), rz, alpha=1.0, beta=a, zero_from=depth)
        if q is None:  # Q = Z + a I, in Z's memory: nothing reads Z after this
            q = z
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = ops.sym_addmm(*_inner(q, z, depth), q, alpha=1.0, beta=a, zero_from=depth)
    if q is None:
        return x
    if column_major:
        return _product(ops, *_inner(x.mT, q, depth), None, 1.0, 0.0, check, None if out is None else out.mT).mT
    return _product(ops, *_inner(q, x, depth), None, 1.0, 0.0, check, out)


def standard_newton_schulz(
    x: torch.Tensor,
    coefficients: Coefficients,
    backend: Backend,
    check: ResultCheck | None = None,
    out: torch.Tensor | None = None,
    depth: int | None = None,
) -> torch.Tensor:
    """Alg. 1 on a wide, normalized x: A = X X^T, B = b A + c A^2, X <- a X + B X. ``check``,
    ``out`` and ``depth``: as in ``gram_newton_schulz``."""
    ops = backend
    last = len(coefficients) - 1
    for t, (a, b, c) in enumerate(coefficients):
        gram = ops.sym_mm(x, x.mT, zero_from=depth)
        poly = ops.sym_addmm(*_inner(gram, gram, depth), gram, alpha=c, beta=b, zero_from=depth)
        x = _product(ops, *_inner(poly, x, depth), x, 1.0, a, *((check, out) if t == last else (None, None)))
    return x


def runs_in_halves(x: torch.Tensor) -> bool:
    """Whether ``orthogonalize`` runs the wide batch x (B, n, m) in two halves (module
    docstring): two matrices or more, a half's X X^T at least ``HALVES_MIN_FLOPS``, and every SM
    free to its kernels. Under ``leave_sms`` (the step's costliest group on a stream of its own,
    optim/overlap.py) the step stream's work already runs in what the last waves leave idle."""
    batch, n, m = x.shape
    if batch < 2 or (batch // 2) * n * n * m < HALVES_MIN_FLOPS:
        return False
    return grid_sms(x.device) == num_sms(x.device)


_SIDE_STREAMS: dict[tuple[torch.device, int], tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def _side_streams(caller: torch.cuda.Stream) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """Two streams of the caller's device and priority (made once, reused every step)."""
    key = (caller.device, caller.priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = tuple(torch.cuda.Stream(caller.device, priority=caller.priority) for _ in range(2))
    return _SIDE_STREAMS[key]


def in_halves(
    x: torch.Tensor,
    run: Callable[[torch.Tensor, ResultCheck | None, torch.Tensor], torch.Tensor],
    check: ResultCheck | None,
    column_major: bool,
) -> torch.Tensor:
    """``run(half, its check, its part of the result)`` on the two halves of the batch x, on two
    side streams on CUDA (one after the other elsewhere), into one result batch of x's shape
    (``column_major``: in the transposed memory order, as ``gram_newton_schulz`` makes it).
    The result and x are the caller's stream's memory, used only inside the fork and join; each
    half's intermediates are its stream's, freed there (its next work waits for the caller's).
    ``check``: the halves' flags joined, where both halves' last products made them."""
    batch, n, m = x.shape
    if column_major:
        out = torch.empty((batch, m, n), dtype=x.dtype, device=x.device).mT
    else:
        out = torch.empty((batch, n, m), dtype=x.dtype, device=x.device)
    parts = (slice(0, (batch + 1) // 2), slice((batch + 1) // 2, batch))
    checks = [None if check is None else ResultCheck() for _ in parts]
    caller = torch.cuda.current_stream(x.device) if x.is_cuda else None
    streams = _side_streams(caller) if caller is not None else (None, None)
    for stream, part, part_check in zip(streams, parts, checks):
        context = contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
        if stream is not None:
            stream.wait_stream(caller)
        dest = out[part]
        with context:
            result = run(x[part], part_check, dest)
            if result.data_ptr() != dest.data_ptr():  # no product made it (no iterations)
                dest.copy_(result)
    for stream in streams if caller is not None else ():
        caller.wait_stream(stream)
    if check is not None and all(c.bad is not None for c in checks):
        check.bad = torch.cat([c.bad for c in checks])
    return out


def orthogonalize(
    x: torch.Tensor,
    settings: NSSettings,
    backend: Backend,
    tall: bool | None = None,
    normalized: bool = False,
    check: ResultCheck | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """polar(x) for a batch x (B, n, m) of either orientation; result in ``settings.dtype``.

    A tall input is processed as its transpose (a view, no copy) and transposed back.
    ``tall`` overrides the orientation when x carries zero padding: the Gram matrix must be
    formed on the side of the real (unpadded) shape that is smaller, or its null space holds
    rounding noise that the iteration amplifies; zero rows or columns stay exactly zero.
    ``normalized``: x is already ``normalize_batch``'s output (scaled, in the compute dtype).
    A Gram side the backend prefers larger (``Backend.gram_side``) is zero-padded here; a
    caller that packs its batch at that side already avoids the copy and names its real
    ``rows`` (a wide x: its rows from there on are zero). The products over the Gram side read
    only to ``Backend.gram_depth``. The result has the real rows. ``check``: the last product
    flags the matrices whose result is not finite, where the backend can (``ResultCheck``).
    """
    if x.ndim != 3:
        raise ValueError(f"orthogonalize expects a (B, n, m) batch, got shape {tuple(x.shape)}")
    if tall is None:
        tall = x.shape[-2] > x.shape[-1]
    if tall and rows is not None:
        raise ValueError(
            "orthogonalize: rows names the real rows of a wide batch packed at its Gram side; got tall=True"
        )
    if tall:
        x = x.mT
    packed, m = x.shape[-2:]
    n = packed if rows is None else rows
    if x.shape[0] == 0:  # a replica's empty share of a batch
        empty = x[:, :n].to(settings.dtype)
        return empty.mT if tall else empty
    algorithm = resolve_algorithm(settings.algorithm, n, m)  # of the real shape, before padding
    # zero rows stay zero: the result's first n rows are unchanged
    side = max(backend.gram_side(n), packed)
    depth = backend.gram_depth(n)
    if not normalized:
        xn = backend.normalize(x, settings.eps, settings.dtype, side)
    elif side > packed:
        xn = torch.nn.functional.pad(x, (0, 0, 0, side - packed))
    else:
        xn = x

    def run(batch: torch.Tensor, batch_check: ResultCheck | None, out: torch.Tensor | None) -> torch.Tensor:
        if algorithm == "gram":
            return gram_newton_schulz(
                batch, settings.coefficients, settings.restarts, backend, tall, batch_check, out, depth
            )
        return standard_newton_schulz(batch, settings.coefficients, backend, batch_check, out, depth)

    column_major = algorithm == "gram" and tall
    out = in_halves(xn, run, check, column_major) if runs_in_halves(xn) else run(xn, check, None)
    out = out[:, :n]
    return out.mT if tall else out
