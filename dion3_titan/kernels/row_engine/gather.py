"""The pack pass: the selected rows of M into the Newton-Schulz batch (or a send buffer),
normalized and cast once, with the error feedback while they are in registers."""

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
    TableCache,
    as_flag,
    matrix_view,
    operand,
    per_row,
    tensor_layout,
    tiles_for,
)


@triton.jit
def _gather_rows_kernel(
    m_ptr,
    m_tab,
    rows_ptr,
    keep_ptr,
    den_ptr,
    out_ptr,
    ok_ptr,
    mu,
    num_sel,
    num_cols,
    out_rows,
    out_cols,
    s_rb,
    s_rk,
    s_ob,
    s_or,
    s_oc,
    M_LAYOUT: tl.constexpr,
    M_ALIGN: tl.constexpr,
    EVERY: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_DEN: tl.constexpr,
    DECAY_M: tl.constexpr,
    HAS_OK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # the matrix
    j = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # destination rows
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_off, m_sr, m_sc, active = matrix_view(m_tab, n, M_LAYOUT, M_ALIGN)
    live = (j < num_sel) & per_row(active, BLOCK_R)  # an inactive matrix is all zeros
    if EVERY:
        src = j
    else:
        src = tl.load(rows_ptr + n * s_rb + j * s_rk, mask=live, other=0)
    if HAS_KEEP:
        live = live & (tl.load(keep_ptr + n * s_rb + j * s_rk, mask=live, other=0) != 0)
    mask = live[:, None] & (cols[None, :] < num_cols)
    m_ptrs = m_ptr + m_off + src.to(tl.int64)[:, None] * m_sr + cols[None, :].to(tl.int64) * m_sc
    x = tl.load(m_ptrs, mask=mask, other=0.0).to(tl.float32)
    if DECAY_M:  # error feedback while the rows are in registers: the update need not read them
        decays = mask
        if HAS_OK:  # a step judged not finite leaves the momentum as it is
            decays = decays & per_row(tl.load(ok_ptr), BLOCK_R)[:, None]
        tl.store(m_ptrs, round_to(x * mu, m_ptr.dtype.element_ty, INTERPRET), mask=decays)
    if HAS_DEN:
        x = tl.div_rn(x, tl.load(den_ptr + n))  # IEEE division, as torch divides
    out_mask = (j < out_rows)[:, None] & (cols[None, :] < out_cols)
    o_ptrs = out_ptr + n * s_ob + j.to(tl.int64)[:, None] * s_or + cols[None, :].to(tl.int64) * s_oc
    tl.store(o_ptrs, round_to(tl.where(mask, x, 0.0), out_ptr.dtype.element_ty, INTERPRET), mask=out_mask)


def gather_rows_group(
    ms: Sequence[torch.Tensor],
    rows: torch.Tensor | None,
    out: torch.Tensor,
    keep: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
    active: Sequence[bool] | None = None,
    cache: TableCache = TABLES,
    mu: float | None = None,
    ok: torch.Tensor | None = None,
) -> None:
    """out (N, K, C_out) <- rows ``rows`` (N, n) of the views ms (B_i, R, C) (N = sum B_i, in
    order; None: every row, in order), divided by ``denominator`` (N,) float32 when given,
    rounded once to out's dtype. Rows past n, columns past C, rows whose ``keep`` (N, n) is
    False, and every row of a view whose ``active`` entry is False are written as zeros: out
    needs no clearing. With ``mu`` the rows gathered (those written as they are, not as zeros)
    are then multiplied by it in place, one rounding (the error feedback of
    ``update_rows_group``'s momenta), unless the 0-dim ``ok`` is zero. Gathered rows must be
    distinct. One launch."""
    N, (R, C) = sum(m.shape[0] for m in ms), ms[0].shape[1:]
    _, K, C_out = out.shape
    n = R if rows is None else rows.shape[1]
    if out.shape[0] != N or n > K or C > C_out or (rows is not None and rows.shape[0] != N):
        raise ValueError(f"gather_rows: cannot place {n} rows of {N} x {R} x {C} into {tuple(out.shape)}")
    if N == 0 or K == 0 or C_out == 0:
        return
    if rows is not None and keep is not None and keep.stride() != rows.stride():
        keep = keep.contiguous()
        rows = rows.contiguous()
    mo = operand(ms, active, cache)
    idx = rows if rows is not None else out  # never read when EVERY
    block_r, block_c, warps = tiles_for("gather", mo.layout, tensor_layout(out))
    block_c = min(block_c, next_power_of_2(C_out))
    grid = (N, cdiv(K, block_r), cdiv(C_out, block_c))
    launch(
        _gather_rows_kernel,
        grid,
        mo.base,
        mo.table,
        idx,
        keep if keep is not None else idx,
        denominator if denominator is not None else out,
        out,
        as_flag(ok) if ok is not None else out,
        float(mu) if mu is not None else 1.0,
        n,
        C,
        K,
        C_out,
        *(rows.stride() if rows is not None else (0, 0)),
        *out.stride(),
        M_LAYOUT=mo.layout,
        M_ALIGN=mo.align,
        EVERY=rows is None,
        HAS_KEEP=keep is not None,
        HAS_DEN=denominator is not None,
        DECAY_M=mu is not None,
        HAS_OK=ok is not None and mu is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        INTERPRET=interpreting(),
        num_warps=warps,
        enable_fp_fusion=False,
    )


def gather_rows(
    m: torch.Tensor,
    rows: torch.Tensor | None,
    out: torch.Tensor,
    keep: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
    active: bool = True,
) -> None:
    """``gather_rows_group`` of one (B, R, C) view (rows (B, n), out (B, K, C_out))."""
    gather_rows_group([m], rows, out, keep, denominator, [active])
