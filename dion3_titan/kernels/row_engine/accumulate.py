"""The accumulate pass: M += G, and each row's l1 norm and sum of squares, in one read of M
(the row engine's first pass of a step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from dion3_titan.kernels.backend import interpreting
from dion3_titan.kernels.launch import cdiv, launch, next_power_of_2
from dion3_titan.kernels.rounding import round_to
from dion3_titan.kernels.row_engine.operands import (
    TABLES,
    MovableOperand,
    TableCache,
    as_flag,
    matrix_view,
    operand,
    per_row,
    tiles_for,
)


@triton.jit
def _accumulate_scores_kernel(
    m_ptr,
    m_tab,
    g_ptr,
    g_tab,
    l1_ptr,
    sq_ptr,
    ok_ptr,
    mu,
    num_rows,
    num_cols,
    s_ob,
    s_or,
    M_LAYOUT: tl.constexpr,
    M_ALIGN: tl.constexpr,
    G_LAYOUT: tl.constexpr,
    G_ALIGN: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_OK: tl.constexpr,
    DECAY_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # the matrix
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    m_off, m_sr, m_sc, _ = matrix_view(m_tab, n, M_LAYOUT, M_ALIGN)
    # elementwise partial sums, reduced once after the loop (no cross-warp reduction per tile)
    l1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    if HAS_G:
        # a matrix without a gradient, or a step judged not finite, leaves the momentum as it is
        g_off, g_sr, g_sc, g_here = matrix_view(g_tab, n, G_LAYOUT, G_ALIGN)
        add = per_row(g_here, BLOCK_R)
        if HAS_OK:
            add = add & per_row(tl.load(ok_ptr), BLOCK_R)
        add = add[:, None]
    for c0 in range(0, num_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cols64 = cols[None, :].to(tl.int64)
        mask = row_ok[:, None] & (cols[None, :] < num_cols)
        m_ptrs = m_ptr + m_off + rows64[:, None] * m_sr + cols64 * m_sc
        m = tl.load(m_ptrs, mask=mask, other=0.0)
        if HAS_G:
            g_ptrs = g_ptr + g_off + rows64[:, None] * g_sr + cols64 * g_sc
            g = tl.load(g_ptrs, mask=mask & add, other=0.0)
            new = round_to(m.to(tl.float32) + g.to(tl.float32), m_ptr.dtype.element_ty, INTERPRET)
            if DECAY_M:  # the error feedback of every row, rounded after the sum as the reference does
                tl.store(m_ptrs, round_to(new.to(tl.float32) * mu, m_ptr.dtype.element_ty, INTERPRET), mask=mask & add)
            else:
                tl.store(m_ptrs, new, mask=mask & add)
            m = tl.where(add, new, m)
        x = m.to(tl.float32)  # the stored value: what the reference scores
        l1 += tl.abs(x)
        sq += x * x
    tl.store(l1_ptr + n * s_ob + rows64 * s_or, tl.sum(l1, axis=1), mask=row_ok)
    tl.store(sq_ptr + n * s_ob + rows64 * s_or, tl.sum(sq, axis=1), mask=row_ok)


def gradient_views(
    ms: Sequence[torch.Tensor], gs: Sequence[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[bool]]:
    """The gradient operand's views and which are present: a matrix without a gradient is
    stood in for by its momentum view (same shape, never read)."""
    return [m if g is None else g for m, g in zip(ms, gs)], [g is not None for g in gs]


def accumulate_scores_group(
    ms: Sequence[torch.Tensor],
    gs: Sequence[torch.Tensor | None] | None,
    l1: torch.Tensor,
    sq: torch.Tensor,
    ok: torch.Tensor | None = None,
    cache: TableCache = TABLES,
    grads: MovableOperand | None = None,
    mu: float | None = None,
) -> None:
    """Each m (B_i, R, C) += its g (same shape; None: only score), in place, rounded once to
    m's dtype; l1 (N, R) and sq (N, R) float32 (N = sum B_i, the views in order) receive each
    row's l1 norm and sum of squares of the new m. ``ok`` (0-dim device tensor): where zero,
    m is left as it is (and scored so). ``grads``: the gradients' operand, built by the caller
    from ``gradient_views(ms, gs)`` (so that a captured launch can be pointed at moved
    gradients). ``mu``: every m that takes its g is then stored times ``mu``, rounded again
    (the error feedback of a selection of every row; the scores stay those of the sum). One
    launch, no host sync."""
    gs = [None] * len(ms) if gs is None else list(gs)
    for m, g in zip(ms, gs):
        if g is not None and g.shape != m.shape:
            raise ValueError(f"accumulate_scores: gradient shape {tuple(g.shape)} != momentum shape {tuple(m.shape)}")
    N, (R, C) = sum(m.shape[0] for m in ms), ms[0].shape[1:]
    if l1.shape != (N, R) or sq.shape != (N, R) or l1.stride() != sq.stride():
        raise ValueError(f"accumulate_scores: l1 and sq must both be ({N}, {R}) with equal strides")
    if N == 0 or R == 0:
        return
    mo = operand(ms, cache=cache)
    has_g = any(g is not None for g in gs)
    if grads is not None:
        go = grads.operand
    elif has_g:
        go = operand(*gradient_views(ms, gs), cache)
    else:
        go = mo
    block_r, block_c, warps = tiles_for("accumulate", mo.layout, go.layout)
    block_c = min(block_c, next_power_of_2(max(C, 1)))
    launch(
        _accumulate_scores_kernel,
        (N, cdiv(R, block_r)),
        mo.base,
        mo.table,
        go.base,
        go.table,
        l1,
        sq,
        as_flag(ok) if ok is not None else l1,
        float(mu) if mu is not None else 1.0,
        R,
        C,
        *l1.stride(),
        M_LAYOUT=mo.layout,
        M_ALIGN=mo.align,
        G_LAYOUT=go.layout,
        G_ALIGN=go.align,
        HAS_G=has_g,
        HAS_OK=ok is not None,
        DECAY_M=mu is not None and has_g,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        INTERPRET=interpreting(),
        num_warps=warps,
        enable_fp_fusion=False,
    )


def accumulate_scores(
    m: torch.Tensor,
    g: torch.Tensor | None,
    l1: torch.Tensor,
    sq: torch.Tensor,
    ok: torch.Tensor | None = None,
    mu: float | None = None,
) -> None:
    """``accumulate_scores_group`` of one (B, R, C) view: l1 and sq are (B, R)."""
    accumulate_scores_group([m], [g], l1, sq, ok, mu=mu)
