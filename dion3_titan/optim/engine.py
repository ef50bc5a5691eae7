"""The row engine: the step's memory-bound stages on fused kernels (GPU, Triton backends).

Where it runs (``runs_on``), a step touches momentum and weights once per stage instead of once
per torch op: accumulate + score, gather + normalize + cast into the Newton-Schulz batch (or
the send buffer), and update + error feedback + NorMuon epilogue. The torch path in dion3.py
and update.py stays the reference; this module computes the same quantities (bit-identical
float32 state where the reference rounds once; norms summed in another order) and is tested
against it.

Each stage is one kernel launch per shape group, whatever the number of its members (layers):
the members' views reach the kernels through device tables kept in a ``TableCache`` (built by
the first step, reused by every later one and by a captured CUDA graph).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from dion3_titan.dist.layout import to_local
from dion3_titan.dist.plan import Member
from dion3_titan.kernels import row_engine as rk
from dion3_titan.kernels.backend import interpreting
from dion3_titan.kernels.row_engine import TABLES, RowState, TableCache
from dion3_titan.optim.moving_grads import MovingGradients
from dion3_titan.optim.nonfinite import NonfiniteGuard

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def runs_on(backend: str, param: torch.Tensor) -> bool:
    """The engine serves a param group whose ``backend`` is not "torch" on a CUDA device (or
    anywhere under Triton's interpreter, for tests), for float32/bf16/fp16 parameters."""
    local = to_local(param)
    return backend != "torch" and (local.is_cuda or interpreting()) and local.dtype in _DTYPES


def untiled_params(
    groups: Sequence[tuple[Sequence[Member], Sequence[torch.Tensor]]], momentum: Callable[[torch.Tensor], torch.Tensor]
) -> dict[int, torch.Tensor]:
    """By id, the parameters of ``groups`` ((members, their momentum views) per shape group)
    whose members' views do not cover the whole of ``momentum(param)``: ``accumulate`` adds
    their gradients apart. What the plan makes, so a caller may keep it."""
    covered: dict[int, int] = {}
    params: dict[int, torch.Tensor] = {}
    for members, views in groups:
        for m, v in zip(members, views):
            covered[id(m.param)] = covered.get(id(m.param), 0) + v.numel()
            params[id(m.param)] = m.param
    return {pid: p for pid, p in params.items() if covered[pid] != momentum(p).numel()}


def accumulate(
    groups: Sequence[tuple[Sequence[Member], Sequence[torch.Tensor], torch.Tensor, torch.Tensor, float | None]],
    grad_of: Callable[[torch.Tensor], torch.Tensor | None],
    guard: NonfiniteGuard,
    untiled: Mapping[int, torch.Tensor],
    momentum: Callable[[torch.Tensor], torch.Tensor],
    tables: TableCache = TABLES,
    moving: MovingGradients | None = None,
) -> list[bool]:
    """M += G once per parameter and every member's row scores, one launch per shape group.
    On a step whose gradients ``guard`` found not finite, M keeps its bits. With ``moving``
    (a captured step), the launches read the gradients through its movable tables.

    ``groups``: (members, their momentum views, l1 (N, R), sq (N, R), mu) per shape group,
    l1 and sq written by the launch; ``mu`` (or None): the group selects every row, and the
    same launch applies their error feedback (M *= mu) to each member that takes a gradient.
    Returns, per group, whether it did so for all of them (else the group's pack must).
    ``grad_of(param)`` gives a local tensor (None: score only). The parameters ``untiled``
    (``untiled_params``) get their gradient in one add to ``momentum(param)`` first, then their
    views are only scored."""
    for p in untiled.values():
        grad = grad_of(p)
        if grad is not None:
            guard.accumulate([momentum(p)], [grad])
    decayed = []
    for members, vs, l1, sq, mu in groups:
        # a parameter added apart (above) keeps its error feedback for the pack
        mu = None if any(id(m.param) in untiled for m in members) else mu
        grads = [None if id(m.param) in untiled else grad_of(m.param) for m in members]
        grads = [None if g is None else m.view(g) for m, g in zip(members, grads)]
        movable = None
        if moving is not None and any(g is not None for g in grads):
            movable = moving.operand(members, *rk.gradient_views(vs, grads))
        rk.accumulate_scores_group(vs, grads, l1, sq, ok=guard.ok, cache=tables, grads=movable, mu=mu)
        decayed.append(mu is not None)
    return decayed


def pack(
    views: Sequence[torch.Tensor],
    rows: torch.Tensor | None,
    valid: torch.Tensor | None,
    active: Sequence[bool],
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    sq: torch.Tensor | None = None,
    eps: float = 0.0,
    transposed: bool = False,
    tables: TableCache = TABLES,
    mu: float | None = None,
    ok: torch.Tensor | None = None,
    norm_scale: torch.Tensor | None = None,
    sumsq: torch.Tensor | None = None,
) -> torch.Tensor:
    """The group's (N, K, C) batch in ``dtype``, in one launch: each member's selected rows
    (``rows`` (N, n), None: all rows in order), zero-padded; rows with ``valid`` (N, n) False
    and inactive members (no gradient) are zero. With ``sq`` (N, R) row sums of squares each
    matrix is divided by its Frobenius norm + eps (the NS input, ``orthogonalize``'s
    normalization), times ``norm_scale`` (0-dim) when given: the views hold the momentum
    that ``sq`` describes times it. ``sumsq`` (N,) replaces the sums ``selected_sumsq`` would
    take from ``sq``: the whole matrix's, where other ranks hold some of its rows or columns.
    ``transposed``: the batch is laid out column-major (for transposed views). ``mu``: the
    error feedback, the rows packed (valid, of active members) times ``mu`` in place after
    they are read, unless ``ok`` (0-dim) is zero: ``update`` then gets no momenta."""
    n, kk, c = shape
    device = views[0].device
    out = (
        torch.empty((n, c, kk), dtype=dtype, device=device).mT
        if transposed
        else torch.empty(shape, dtype=dtype, device=device)
    )
    den = None
    if sumsq is None and sq is not None:
        sumsq = selected_sumsq(sq, rows, valid)
    if sumsq is not None:
        den = sumsq.sqrt() + eps
        if norm_scale is not None:
            den = den * norm_scale
    rk.gather_rows_group(views, rows, out, keep=valid, denominator=den, active=active, cache=tables, mu=mu, ok=ok)
    return out


def selected_sumsq(sq: torch.Tensor, rows: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor:
    """(N,) float32: per matrix, the sum of the row sums of squares ``sq`` (N, R) over the rows
    ``rows`` (N, n) (None: every row) whose ``valid`` entry is True: the square of the norm of
    what ``pack`` gathers, without reading the momentum."""
    if rows is None:
        return sq.sum(dim=1)
    picked = sq.gather(1, rows)
    if valid is not None:
        picked = picked * valid
    return picked.sum(dim=1)


def gather_row_state(
    views: Sequence[torch.Tensor], rows: torch.Tensor, k: int, tables: TableCache = TABLES
) -> torch.Tensor:
    """(N, k) float32: the selected rows ``rows`` (N, n) of the members' per-row state views
    (B_i, R), zero past n, in one launch (the reference's gather and pad)."""
    out = torch.empty(rows.shape[0], k, 1, dtype=torch.float32, device=rows.device)
    rk.gather_rows_group(rk.column_views(views), rows, out, cache=tables)
    return out.squeeze(-1)


def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 sums of squares of the rows of x (N, K, C), one pass."""
    n, kk, _ = x.shape
    l1 = torch.empty(n, kk, dtype=torch.float32, device=x.device)
    sq = torch.empty_like(l1)
    rk.accumulate_scores(x, None, l1, sq)
    return sq


def normuon_factors(
    rowsq: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, cols: int, void: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NorMuon (update.normuon_factors) as factors for the update kernel's epilogue: returns
    (row denominators sqrt(v_new) + eps (N, K), matrix scales ||o|| / ||o_hat|| (N,), v_new)
    from the NS result's rows' sums of squares ``rowsq`` (N, K) (``row_sumsq``), in one small
    launch. ``void`` (N,): matrices taken as zero."""
    return rk.normuon_factors(rowsq, v, beta2, eps, cols, void)


def slots(rows: torch.Tensor, valid: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """(N, num_rows) int32 map of a group's selection for ``update``: each row's position in
    ``rows`` (N, k), -1 where it is not selected or its ``valid`` entry is False."""
    return rk.row_slots(rows, num_rows, valid)


def applied_rows(rows: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """(N, k) int64 map of a group's selection for an ``update`` without weight decay: the
    row of each selected slot, -1 where its ``valid`` entry is False."""
    return rk.applied_rows(rows, valid)


def decay_unselected(
    weights: Sequence[torch.Tensor],
    slot: torch.Tensor,
    decay: torch.Tensor,
    ok: torch.Tensor | None,
    active: Sequence[bool],
    tables: TableCache = TABLES,
) -> None:
    """The weight decay of the rows ``slot`` (from ``slots``) leaves out, in one launch: with
    ``update(rows=...)`` of the selected rows, the same as ``update`` over every row."""
    rk.decay_unselected_group(weights, slot, decay, ok, active, tables)


def update(
    weights: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor] | None,
    result: torch.Tensor,
    slot: torch.Tensor | None,
    lr: torch.Tensor,
    decay: torch.Tensor | None,
    mu: float,
    lr_scales: Sequence[float],
    den: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    ok: torch.Tensor | None = None,
    void: torch.Tensor | None = None,
    row_state: RowState | None = None,
    active: Sequence[bool] | None = None,
    tables: TableCache = TABLES,
    rows: torch.Tensor | None = None,
) -> None:
    """update.apply_update of a whole shape group (+ the flavor's epilogue when ``den``/
    ``scale`` are given, + its new per-row state) in one pass (``momenta`` None: their error
    feedback was applied by ``pack``); ``slot`` from ``slots`` (None:
    every row, in order, f = 1); member i's learning rate is ``lr * lr_scales[i]``; ``decay``
    None: no weight decay (the rows that are not selected stay unread). ``rows`` from
    ``applied_rows`` may replace ``slot``: the launch visits the selected rows only, and with
    ``decay`` the other rows are ``decay_unselected``'s."""
    rk.update_rows_group(
        weights,
        momenta,
        result,
        slot,
        lr,
        decay,
        mu,
        lr_scales,
        den,
        scale,
        ok,
        void,
        row_state,
        active,
        tables,
        rows,
    )
