"""The row engine: the step's memory-bound stages on fused kernels (GPU, Triton backends).

Where it runs (``runs_on``), a step touches momentum and weights once per stage instead of once
per torch op: accumulate + score, gather + normalize + cast into the Newton-Schulz batch (or
the send buffer), and update + error feedback + NorMuon epilogue. The torch path in dion3.py
and update.py stays the reference; this module computes the same quantities (bit-identical
float32 state where the reference rounds once; norms summed in another order) and is tested
against it.
"""

from __future__ import annotations

import torch

from dion3_titan.dist.layout import to_local
from dion3_titan.kernels import row_engine as rk
from dion3_titan.kernels.backend import interpreting
from dion3_titan.optim.nonfinite import NonfiniteGuard

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def runs_on(backend: str, param: torch.Tensor) -> bool:
    """The engine serves a param group whose ``backend`` is not "torch" on a CUDA device (or
    anywhere under Triton's interpreter, for tests), for float32/bf16/fp16 parameters."""
    local = to_local(param)
    return backend != "torch" and (local.is_cuda or interpreting()) and local.dtype in _DTYPES


def accumulate(members_of: dict[int, list], momentum, grad_of, guard: NonfiniteGuard) -> None:
    """M += G once per parameter and every member's row scores, in one pass where the members'
    views tile the parameter (the usual case); otherwise one add, then a scoring pass. On a
    step whose gradients ``guard`` found not finite, M keeps its bits.

    ``members_of``: id(param) -> [(member, l1 slice, sq slice)]; ``momentum(param)`` and
    ``grad_of(param)`` give local tensors (grad None: score only). Writes the slices."""
    for entries in members_of.values():
        param = entries[0][0].param
        mom, grad = momentum(param), grad_of(param)
        views = [m.view(mom) for m, _, _ in entries]
        tiles = sum(v.numel() for v in views) == mom.numel()
        if grad is not None and not tiles:
            guard.accumulate([mom], [grad])
        for (m, l1, sq), view in zip(entries, views):
            g = m.view(grad) if grad is not None and tiles else None
            rk.accumulate_scores(view, g, l1, sq, ok=guard.ok)


def pack(
    views: list[torch.Tensor],
    rows: list[torch.Tensor] | None,
    valid: list[torch.Tensor] | None,
    active: list[bool],
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    sq: torch.Tensor | None = None,
    eps: float = 0.0,
    transposed: bool = False,
) -> torch.Tensor:
    """The group's (N, K, C) batch in ``dtype``: each member's selected rows (``rows`` per
    member, None: all rows in order), zero-padded; rows with ``valid`` False and inactive
    members (no gradient) are zero. With ``sq`` (N, R) row sums of squares each matrix is
    divided by its Frobenius norm + eps (the NS input, ``orthogonalize``'s normalization).
    ``transposed``: the batch is laid out column-major (for transposed views)."""
    n, kk, c = shape
    device = views[0].device
    out = (
        torch.empty((n, c, kk), dtype=dtype, device=device).mT
        if transposed
        else torch.empty(shape, dtype=dtype, device=device)
    )
    den = None
    if sq is not None:
        if rows is None:
            ss = sq.sum(dim=1)
        else:
            picked = sq.gather(1, torch.cat(rows))
            if valid is not None:
                picked = picked * torch.cat(valid)
            ss = picked.sum(dim=1)
        den = ss.sqrt() + eps
    start = 0
    for i, view in enumerate(views):
        b = view.shape[0]
        sl = slice(start, start + b)
        rk.gather_rows(
            view,
            None if rows is None else rows[i],
            out[sl],
            keep=None if valid is None else valid[i],
            denominator=None if den is None else den[sl],
            active=active[i],
        )
        start += b
    return out


def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 sums of squares of the rows of x (N, K, C), one pass."""
    n, kk, _ = x.shape
    l1 = torch.empty(n, kk, dtype=torch.float32, device=x.device)
    sq = torch.empty_like(l1)
    rk.accumulate_scores(x, None, l1, sq)
    return sq


def normuon_factors(
    o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, cols: int, void: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NorMuon (update.normuon_normalize) as factors for the update kernel's epilogue: returns
    (row denominators sqrt(v_new) + eps (N, K), matrix scales ||o|| / ||o_hat|| (N,), v_new),
    from one pass over o for its rows' sums of squares. ``void`` (N,): matrices taken as zero."""
    rowsq = row_sumsq(o)
    if void is not None:
        rowsq = torch.where(void[:, None], 0.0, rowsq)
    v_new = v.float() * beta2 + (1.0 - beta2) * rowsq / cols
    den = v_new.sqrt() + eps
    norm_o = rowsq.sum(dim=1).sqrt()
    norm_hat = (rowsq / den.square()).sum(dim=1).sqrt()
    scale = norm_o / norm_hat.clamp_min(torch.finfo(torch.float32).tiny)
    return den, scale, v_new


def slots(rows: torch.Tensor, valid: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """(N, num_rows) int32 map of a group's selection for ``update``: each row's position in
    ``rows`` (N, k), -1 where it is not selected or its ``valid`` entry is False."""
    return rk.row_slots(rows, num_rows, valid)


def update(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    result: torch.Tensor,
    slot: torch.Tensor | None,
    lr: torch.Tensor,
    decay: torch.Tensor,
    mu: float,
    den: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    ok: torch.Tensor | None = None,
    void: torch.Tensor | None = None,
) -> None:
    """update.apply_update (+ the flavor's epilogue when ``den``/``scale`` are given) in one
    pass; ``slot`` from ``slots`` (None: every row, in order, f = 1)."""
    rk.update_rows(weight, momentum, result, slot, lr, decay, mu, den, scale, ok, void)
