"""The update pass: W <- decay * W, W[sel] -= lr * U (with NorMuon's epilogue), and the
selected rows' new per-row state, in one pass; and the decay of the rows not selected."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    column_views,
    matrix_view,
    operand,
    per_row,
    scales_table,
    tiles_for,
)


@triton.jit
def _update_rows_kernel(
    w_ptr,
    w_tab,
    m_ptr,
    m_tab,
    v_ptr,
    v_tab,
    u_ptr,
    slot_ptr,
    v_new_ptr,
    lr_ptr,
    lr_scale_ptr,
    decay_ptr,
    den_ptr,
    scale_ptr,
    ok_ptr,
    void_ptr,
    mu,
    num_rows,
    num_slots,
    num_cols,
    s_ub,
    s_uk,
    s_uc,
    s_sb,
    s_sr,
    s_db,
    s_dk,
    s_nb,
    s_nk,
    W_LAYOUT: tl.constexpr,
    W_ALIGN: tl.constexpr,
    M_LAYOUT: tl.constexpr,
    M_ALIGN: tl.constexpr,
    EVERY: tl.constexpr,
    BY_SLOT: tl.constexpr,
    UNSELECTED: tl.constexpr,
    NORMUON: tl.constexpr,
    HAS_OK: tl.constexpr,
    HAS_VOID: tl.constexpr,
    DECAY_M: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_LR_SCALE: tl.constexpr,
    HAS_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # the matrix
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    w_off, w_sr, w_sc, active = matrix_view(w_tab, n, W_LAYOUT, W_ALIGN)
    if BY_SLOT:  # the programs walk the selected rows: slot_ptr[n, s] is slot s's row (-1: none)
        slot = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_k = (slot < num_slots) & per_row(active, BLOCK_R)
        picked = tl.load(slot_ptr + n * s_sb + slot * s_sr, mask=in_k, other=-1)
        row_ok = in_k & (picked >= 0)
        rows = tl.maximum(picked, 0).to(tl.int32)
    else:  # the programs walk every row
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = (rows < num_rows) & per_row(active, BLOCK_R)  # an inactive matrix is left as it is
        if EVERY:
            slot = rows
        else:  # slot[n, r]: position of row r among the selected rows, -1 if not selected
            slot = tl.load(slot_ptr + n * s_sb + rows * s_sr, mask=row_ok, other=-1)
    selected = row_ok & (slot >= 0)
    if HAS_OK:  # a step judged not finite leaves weights, momentum and row state as they are
        selected = selected & per_row(tl.load(ok_ptr), BLOCK_R)
    mask = row_ok[:, None] & (cols[None, :] < num_cols)
    sel_mask = selected[:, None] & mask
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    rows64 = rows[:, None].to(tl.int64)
    cols64 = cols[None, :].to(tl.int64)
    lr = tl.load(lr_ptr)
    if HAS_LR_SCALE:  # the member's learning-rate multiplier, as the reference's lr * scale
        lr = lr * tl.load(lr_scale_ptr + n)
    w_ptrs = w_ptr + w_off + rows64 * w_sr + cols64 * w_sc
    if HAS_DECAY:
        decay = tl.load(decay_ptr)
        if HAS_OK:
            decay = tl.where(tl.load(ok_ptr).to(tl.int32) != 0, decay, 1.0)
        w_mask = mask
        if UNSELECTED:  # the decay of the rows the selection leaves (the others: a BY_SLOT launch)
            w_mask = (row_ok & (slot < 0))[:, None] & (cols[None, :] < num_cols)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        # The reference's roundings, (w * decay) - (lr * u); the launch disables FMA contraction.
        new = w * decay
    else:  # no weight decay: the rows that are not selected are neither read nor written
        w_mask = sel_mask
        new = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
    # Most tiles hold no selected row (f < 1): they only decay, with no update arithmetic.
    if not UNSELECTED:
        if tl.max(selected.to(tl.int32), axis=0) > 0:
            u = tl.load(u_ptr + n * s_ub + slot64[:, None] * s_uk + cols64 * s_uc, mask=sel_mask, other=0.0)
            u = u.to(tl.float32)
            if NORMUON:  # the reference's o_hat = (o / (sqrt(v) + eps)) * (||o|| / ||o_hat||)
                den = tl.load(den_ptr + n * s_db + slot64 * s_dk, mask=selected, other=1.0)
                u = tl.div_rn(u, den[:, None]) * tl.load(scale_ptr + n)  # IEEE division, as torch
            if HAS_VOID:  # a matrix whose result was not finite gets a zero update (as if O were 0)
                u = tl.where(per_row(tl.load(void_ptr + n), BLOCK_R)[:, None], 0.0, u)
            new = tl.where(selected[:, None], new - lr * u, new)
            if DECAY_M:  # error feedback: only the selected momentum rows decay
                m_off, m_sr, m_sc, _ = matrix_view(m_tab, n, M_LAYOUT, M_ALIGN)
                m_ptrs = m_ptr + m_off + rows64 * m_sr + cols64 * m_sc
                m = tl.load(m_ptrs, mask=sel_mask, other=0.0).to(tl.float32)
                tl.store(m_ptrs, round_to(m * mu, m_ptr.dtype.element_ty, INTERPRET), mask=sel_mask)
            if HAS_V:  # NorMuon's new second moment of the selected rows, by the first column block
                v_sel = selected & per_row(tl.program_id(2) == 0, BLOCK_R)
                v_off, v_sr, _, _ = matrix_view(v_tab, n, 1, 1)  # (B, R, 1) views: the column is 0
                v = tl.load(v_new_ptr + n * s_nb + slot64 * s_nk, mask=v_sel, other=0.0)
                tl.store(v_ptr + v_off + rows.to(tl.int64) * v_sr, v.to(v_ptr.dtype.element_ty), mask=v_sel)
    tl.store(w_ptrs, round_to(new, w_ptr.dtype.element_ty, INTERPRET), mask=w_mask)


def row_slots(rows: torch.Tensor, num_rows: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """(B, num_rows) int32: the position of each row in ``rows`` (B, k), -1 where a row is not
    selected or its ``keep`` entry is False. Device ops only (graph-capturable)."""
    B, k = rows.shape
    slot = torch.full((B, num_rows), -1, dtype=torch.int32, device=rows.device)
    if k:
        pos = torch.arange(k, dtype=torch.int32, device=rows.device).expand(B, k)
        if keep is not None:
            pos = torch.where(keep, pos, -1)
        slot.scatter_(1, rows, pos)
    return slot


def applied_rows(rows: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """(B, k) int64: ``rows`` (B, k) with -1 where ``keep`` is False: the rows an update
    without weight decay visits (``update_rows_group``'s ``rows``)."""
    rows = rows.to(torch.int64)
    return rows if keep is None else torch.where(keep, rows, -1)


@dataclass(frozen=True)
class RowState:
    """A per-row state written by ``update_rows_group``: the members' (B_i, R) views and the
    new values (N, k) float32 of the selected rows (by slot)."""

    views: Sequence[torch.Tensor]
    new: torch.Tensor


def update_rows_group(
    weights: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor] | None,
    update: torch.Tensor,
    slot: torch.Tensor | None,
    lr: torch.Tensor,
    decay: torch.Tensor | None,
    mu: float,
    lr_scales: Sequence[float] | None = None,
    row_denominator: torch.Tensor | None = None,
    matrix_scale: torch.Tensor | None = None,
    ok: torch.Tensor | None = None,
    void: torch.Tensor | None = None,
    row_state: RowState | None = None,
    active: Sequence[bool] | None = None,
    cache: TableCache = TABLES,
    rows: torch.Tensor | None = None,
) -> None:
    """In place on the weight and momentum views (B_i, R, C) (N = sum B_i, in order): every
    weight row times ``decay``; the selected rows (``slot`` (N, R) from ``row_slots``; None:
    every row, update row r for weight row r; or ``rows`` (N, k) from ``applied_rows``, the
    row of each update row, and then only those rows are visited: a launch over every row
    would leave (1 - f) of its programs idle; with weight decay the other rows are then left
    to ``decay_unselected_group``) minus
    ``lr * lr_scales[i] * U``, one rounding;
    their momentum rows times ``mu`` (skipped when momenta is None); their ``row_state`` rows
    set to its new values. U = update (N, k, C+) in float32, or with ``row_denominator``
    (N, k) and ``matrix_scale`` (N,) the NorMuon form (update / denominator) * scale. ``lr``,
    ``decay`` and ``ok`` (nonzero: apply) are 0-dim device tensors, read live under graph
    replay; ``decay`` None: no weight decay, and the rows that are not selected are left
    untouched (neither read nor written: (1 - f) of the weights' traffic). ``void`` (N,) bool:
    matrices whose U counts as zero (decay and error feedback still run). Views whose
    ``active`` entry is False are left as they are. One launch."""
    N, (R, C) = sum(w.shape[0] for w in weights), weights[0].shape[1:]
    if momenta is not None and [m.shape for m in momenta] != [w.shape for w in weights]:
        raise ValueError("update_rows: momentum and weight views differ in shape")
    every = slot is None and rows is None
    k = R if every else update.shape[1]
    if update.shape[0] != N or update.shape[1] < (R if every else 0) or update.shape[2] < C:
        raise ValueError(f"update_rows: update {tuple(update.shape)} does not cover {N} x {R} x {C}")
    if slot is not None and slot.shape != (N, R):
        raise ValueError(f"update_rows: slot must be ({N}, {R}), got {tuple(slot.shape)}")
    if rows is not None and (slot is not None or rows.shape != (N, k)):
        raise ValueError(
            f"update_rows: rows ({N}, {k}) replaces slot; got rows {tuple(rows.shape)}, slot "
            f"{'given' if slot is not None else None}"
        )
    index = rows if rows is not None else slot
    normuon = row_denominator is not None
    if normuon and (matrix_scale is None or row_denominator.shape[:2] != (N, k) or matrix_scale.shape != (N,)):
        raise ValueError("update_rows: NorMuon needs row_denominator (N, k) and matrix_scale (N,)")
    if void is not None and void.shape != (N,):
        raise ValueError(f"update_rows: void must be ({N},), got {tuple(void.shape)}")
    if row_state is not None and row_state.new.shape[:2] != (N, k):
        raise ValueError(f"update_rows: row state values must be ({N}, {k}), got {tuple(row_state.new.shape)}")
    if N == 0 or R == 0 or C == 0:
        return
    wo = operand(weights, active, cache)
    mo = operand(momenta, active, cache) if momenta is not None else wo
    vo = operand(column_views(row_state.views), active, cache) if row_state is not None else wo
    v_new = row_state.new if row_state is not None else update
    scales = None
    if lr_scales is not None:
        scales = scales_table([s for w, s in zip(weights, lr_scales) for _ in range(w.shape[0])], lr.device, cache)
    void = as_flag(void.contiguous()) if void is not None else None
    block_r, block_c, warps = tiles_for("update", wo.layout, mo.layout)
    block_c = min(block_c, next_power_of_2(C))
    grid = (N, cdiv(k if rows is not None else R, block_r), cdiv(C, block_c))
    launch(
        _update_rows_kernel,
        grid,
        wo.base,
        wo.table,
        mo.base,
        mo.table,
        vo.base,
        vo.table,
        update,
        index if index is not None else lr,
        v_new,
        lr,
        scales if scales is not None else lr,
        decay if decay is not None else lr,
        row_denominator if normuon else lr,
        matrix_scale if normuon else lr,
        as_flag(ok) if ok is not None else lr,
        void if void is not None else lr,
        float(mu),
        R,
        k,
        C,
        *update.stride(),
        *(index.stride() if index is not None else (0, 0)),
        *(row_denominator.stride()[:2] if normuon else (0, 0)),
        *(v_new.stride()[:2] if row_state is not None else (0, 0)),
        W_LAYOUT=wo.layout,
        W_ALIGN=wo.align,
        M_LAYOUT=mo.layout,
        M_ALIGN=mo.align,
        EVERY=every,
        BY_SLOT=rows is not None,
        UNSELECTED=False,
        NORMUON=normuon,
        HAS_OK=ok is not None,
        HAS_VOID=void is not None,
        DECAY_M=momenta is not None,
        HAS_DECAY=decay is not None,
        HAS_LR_SCALE=scales is not None,
        HAS_V=row_state is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        INTERPRET=interpreting(),
        num_warps=warps,
        enable_fp_fusion=False,
    )


def decay_unselected_group(
    weights: Sequence[torch.Tensor],
    slot: torch.Tensor,
    decay: torch.Tensor,
    ok: torch.Tensor | None = None,
    active: Sequence[bool] | None = None,
    cache: TableCache = TABLES,
) -> None:
    """W <- decay * W on the rows of the weight views (B_i, R, C) that ``slot`` (N, R) from
    ``row_slots`` leaves out (-1), one rounding, in one launch: with ``update_rows_group``'s
    ``rows`` launch over the selected rows, the same result as its launch over every row, in
    two parts that touch disjoint rows (they may run on two streams). ``decay`` and ``ok`` as
    there (a step judged not finite leaves every row as it is)."""
    N, (R, C) = sum(w.shape[0] for w in weights), weights[0].shape[1:]
    if slot.shape != (N, R):
        raise ValueError(f"decay_unselected: slot must be ({N}, {R}), got {tuple(slot.shape)}")
    if N == 0 or R == 0 or C == 0:
        return
    wo = operand(weights, active, cache)
    block_r, block_c, warps = tiles_for("update", wo.layout, wo.layout)
    block_c = min(block_c, next_power_of_2(C))
    launch(
        _update_rows_kernel,
        (N, cdiv(R, block_r), cdiv(C, block_c)),
        # the update kernel's arguments in its order; UNSELECTED reads only the weights, the
        # slot map, decay and ok: every other pointer is a stand-in, every other stride 0
        *(wo.base, wo.table),  # weights
        *(wo.base, wo.table, wo.base, wo.table),  # momenta, row state: not read
        decay,  # update: not read
        slot,
        *(decay, decay, decay),  # new row state, lr, lr scales: not read
        decay,
        *(decay, decay),  # NorMuon's denominators and scales: not read
        as_flag(ok) if ok is not None else decay,
        decay,  # void: not read
        1.0,  # mu: not used
        *(R, 0, C),  # rows, slots, columns
        *(0, 0, 0),  # update strides
        *slot.stride(),
        *(0, 0, 0, 0),  # denominator and row-state strides
        W_LAYOUT=wo.layout,
        W_ALIGN=wo.align,
        M_LAYOUT=wo.layout,
        M_ALIGN=wo.align,
        EVERY=False,
        BY_SLOT=False,
        UNSELECTED=True,
        NORMUON=False,
        HAS_OK=ok is not None,
        HAS_VOID=False,
        DECAY_M=False,
        HAS_DECAY=True,
        HAS_LR_SCALE=False,
        HAS_V=False,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        INTERPRET=interpreting(),
        num_warps=warps,
        enable_fp_fusion=False,
    )


def update_rows(
    weight: torch.Tensor,
    momentum: torch.Tensor | None,
    update: torch.Tensor,
    slot: torch.Tensor | None,
    lr: torch.Tensor,
    decay: torch.Tensor | None,
    mu: float,
    row_denominator: torch.Tensor | None = None,
    matrix_scale: torch.Tensor | None = None,
    ok: torch.Tensor | None = None,
    void: torch.Tensor | None = None,
) -> None:
    """``update_rows_group`` of one (B, R, C) weight view (and its momentum view)."""
    update_rows_group(
        [weight],
        None if momentum is None else [momentum],
        update,
        slot,
        lr,
        decay,
        mu,
        row_denominator=row_denominator,
        matrix_scale=matrix_scale,
        ok=ok,
        void=void,
    )
