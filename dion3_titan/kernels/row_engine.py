"""The row engine's Triton kernels: the memory-bound passes of a Dion3 step, each byte once.

At f < 1 a step is a small Newton-Schulz wrapped in passes over float32 momentum and weights.
Three kernels cover those passes, each on one (B, R, C) view (any strides: row-major,
transposed for column selection, strided pieces, 3D stacks):

* ``accumulate_scores``: M += G, and each row's l1 norm (selection) and sum of squares (so the
  Frobenius norm of the selected rows needs no second read of M), in one pass.
* ``gather_rows``: the selected rows of M straight into the zero-padded Newton-Schulz batch or
  send buffer, divided by a per-matrix denominator (the normalization) and cast once.
* ``update_rows``: W <- decay * W on every row, W[sel] -= lr * U with one rounding, M[sel] *= mu
  (error feedback), and the NorMuon epilogue U = (O / d_row) * s_matrix, in one pass.

The arithmetic follows the torch reference path operation for operation (no FMA contraction),
so float32 state comes out bit-identical where the reference rounds once. Everything here runs
under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests check it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dion3_titan.kernels.backend import interpreting
from dion3_titan.kernels.triton_ops import round_to

# (BLOCK_R, BLOCK_C, num_warps) per kernel when every view's columns are contiguous (wide row
# tiles), and for views that run along rows (transposed: square tiles keep loads coalesced).
# scripts/bench_row_engine.py measures the candidates on a GPU.
TILES: dict[str, tuple[int, int, int]] = {
    "accumulate": (1, 2048, 8),
    "gather": (2, 1024, 4),
    "update": (2, 1024, 4),
    "transposed": (64, 64, 4),
}


def _tiles(kind: str, *views: torch.Tensor) -> tuple[int, int, int]:
    if all(v.stride(-1) == 1 or v.shape[-1] == 1 for v in views):
        return TILES[kind]
    return TILES["transposed"]


@triton.jit
def _accumulate_scores_kernel(
    m_ptr,
    g_ptr,
    l1_ptr,
    sq_ptr,
    ok_ptr,
    num_rows,
    num_cols,
    s_mb,
    s_mr,
    s_mc,
    s_gb,
    s_gr,
    s_gc,
    s_ob,
    s_or,
    HAS_G: tl.constexpr,
    HAS_OK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    # elementwise partial sums, reduced once after the loop (no cross-warp reduction per tile)
    l1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    if HAS_OK:  # a step judged not finite leaves the momentum as it is
        add = ((tl.zeros([BLOCK_R], dtype=tl.int32) + tl.load(ok_ptr).to(tl.int32)) != 0)[:, None]
    for c0 in range(0, num_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols[None, :] < num_cols)
        m_ptrs = m_ptr + batch * s_mb + rows64[:, None] * s_mr + cols[None, :].to(tl.int64) * s_mc
        m = tl.load(m_ptrs, mask=mask, other=0.0)
        if HAS_G:
            g_ptrs = g_ptr + batch * s_gb + rows64[:, None] * s_gr + cols[None, :].to(tl.int64) * s_gc
            g = tl.load(g_ptrs, mask=mask, other=0.0)
            new = round_to(m.to(tl.float32) + g.to(tl.float32), m_ptr.dtype.element_ty, INTERPRET)
            if HAS_OK:
                tl.store(m_ptrs, new, mask=mask & add)
                m = tl.where(add, new, m)
            else:
                tl.store(m_ptrs, new, mask=mask)
                m = new
        x = m.to(tl.float32)  # the stored value: what the reference scores
        l1 += tl.abs(x)
        sq += x * x
    tl.store(l1_ptr + batch * s_ob + rows64 * s_or, tl.sum(l1, axis=1), mask=row_ok)
    tl.store(sq_ptr + batch * s_ob + rows64 * s_or, tl.sum(sq, axis=1), mask=row_ok)


def accumulate_scores(
    m: torch.Tensor, g: torch.Tensor | None, l1: torch.Tensor, sq: torch.Tensor, ok: torch.Tensor | None = None
) -> None:
    """m (B, R, C) += g (same shape; None: only score), in place, rounded once to m's dtype;
    l1 (B, R) and sq (B, R) float32 receive each row's l1 norm and sum of squares of the new
    m. ``ok`` (0-dim device tensor): where zero, m is left as it is (and scored so). No host
    sync."""
    B, R, C = m.shape
    if g is not None and g.shape != m.shape:
        raise ValueError(f"accumulate_scores: gradient shape {tuple(g.shape)} != momentum shape {tuple(m.shape)}")
    if l1.shape != (B, R) or sq.shape != (B, R) or l1.stride() != sq.stride():
        raise ValueError(f"accumulate_scores: l1 and sq must both be ({B}, {R}) with equal strides")
    if B == 0 or R == 0:
        return
    block_r, block_c, warps = _tiles("accumulate", m) if g is None else _tiles("accumulate", m, g)
    block_c = min(block_c, triton.next_power_of_2(max(C, 1)))
    g_arg, g_strides = (g, g.stride()) if g is not None else (m, (0, 0, 0))
    grid = (B, triton.cdiv(R, block_r))
    if ok is not None and ok.dtype == torch.bool:
        ok = ok.view(torch.uint8)  # same byte, a dtype every Triton loads
    _accumulate_scores_kernel[grid](
        m,
        g_arg,
        l1,
        sq,
        ok if ok is not None else l1,
        R,
        C,
        *m.stride(),
        *g_strides,
        *l1.stride(),
        HAS_G=g is not None,
        HAS_OK=ok is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        INTERPRET=interpreting(),
        num_warps=warps,
        enable_fp_fusion=False,
    )


@triton.jit
def _gather_rows_kernel(
    m_ptr,
    rows_ptr,
    keep_ptr,
    den_ptr,
    out_ptr,
    num_sel,
    num_cols,
    out_rows,
    out_cols,
    s_mb,
    s_mr,
    s_mc,
    s_rb,
    s_rk,
    s_ob,
    s_or,
    s_oc,
    EVERY: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_DEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # destination rows
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = j < num_sel
    if EVERY:
        src = j
    else:
        src = tl.load(rows_ptr + batch * s_rb + j * s_rk, mask=live, other=0)
    if HAS_KEEP:
        live = live & (tl.load(keep_ptr + batch * s_rb + j * s_rk, mask=live, other=0) != 0)
    mask = live[:, None] & (cols[None, :] < num_cols)
    m_ptrs = m_ptr + batch * s_mb + src.to(tl.int64)[:, None] * s_mr + cols[None, :].to(tl.int64) * s_mc
    x = tl.load(m_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DEN:
        x = tl.div_rn(x, tl.load(den_ptr + batch))  # IEEE division, as torch divides
    out_mask = (j < out_rows)[:, None] & (cols[None, :] < out_cols)
    o_ptrs = out_ptr + batch * s_ob + j.to(tl.int64)[:, None] * s_or + cols[None, :].to(tl.int64) * s_oc
    tl.store(o_ptrs, round_to(tl.where(mask, x, 0.0), out_ptr.dtype.element_ty, INTERPRET), mask=out_mask)


def gather_rows(
    m: torch.Tensor,
    rows: torch.Tensor | None,
    out: torch.Tensor,
    keep: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
    active: bool = True,
) -> None:
    """out (B, K, C_out) <- rows ``rows`` (B, n) of m (B, R, C) (None: every row, in order),
    divided by ``denominator`` (B,) float32 when given, rounded once to out's dtype. Rows past
    n, columns past C, rows whose ``keep`` (B, n) is False, and everything when ``active`` is
    False are written as zeros: out needs no clearing."""
    B, R, C = m.shape
    _, K, C_out = out.shape
    n = R if rows is None else rows.shape[1]
    if out.shape[0] != B or n > K or C > C_out:
        raise ValueError(f"gather_rows: cannot place {n} rows of {tuple(m.shape)} into {tuple(out.shape)}")
    if B == 0 or K == 0 or C_out == 0:
        return
    if rows is not None and keep is not None and keep.stride() != rows.stride():
        keep = keep.contiguous()
        rows = rows.contiguous()
    idx = rows if rows is not None else out  # never read when EVERY
    r_strides = rows.stride() if rows is not None else (0, 0)
    block_r, block_c, warps = _tiles("gather", m, out)
    block_c = min(block_c, triton.next_power_of_2(C_out))
    grid = (B, triton.cdiv(K, block_r), triton.cdiv(C_out, block_c))
    _gather_rows_kernel[grid](
        m,
        idx,
        keep if keep is not None else idx,
        denominator if denominator is not None else out,
        out,
        n if active else 0,
        C,
        K,
        C_out,
        *m.stride(),
        *r_strides,
        *out.stride(),
        EVERY=rows is None,
        HAS_KEEP=keep is not None,
        HAS_DEN=denominator is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        INTERPRET=interpreting(),
        num_warps=warps,
        enable_fp_fusion=False,
    )


@triton.jit
def _update_rows_kernel(
    w_ptr,
    m_ptr,
    u_ptr,
    slot_ptr,
    lr_ptr,
    decay_ptr,
    den_ptr,
    scale_ptr,
    ok_ptr,
    void_ptr,
    mu,
    num_rows,
    num_cols,
    s_wb,
    s_wr,
    s_wc,
    s_mb,
    s_mr,
    s_mc,
    s_ub,
    s_uk,
    s_uc,
    s_sb,
    s_sr,
    s_db,
    s_dk,
    EVERY: tl.constexpr,
    NORMUON: tl.constexpr,
    HAS_OK: tl.constexpr,
    HAS_VOID: tl.constexpr,
    DECAY_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < num_rows
    if EVERY:
        slot = rows
    else:  # slot[b, r]: position of row r among the selected rows, -1 if not selected
        slot = tl.load(slot_ptr + batch * s_sb + rows * s_sr, mask=row_ok, other=-1)
    selected = row_ok & (slot >= 0)
    if HAS_OK:  # a step judged not finite leaves weights and momentum as they are
        ok_rows = tl.zeros([BLOCK_R], dtype=tl.int32) + tl.load(ok_ptr).to(tl.int32)
        selected = selected & (ok_rows != 0)
    mask = row_ok[:, None] & (cols[None, :] < num_cols)
    sel_mask = selected[:, None] & mask
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    cols64 = cols[None, :].to(tl.int64)
    lr = tl.load(lr_ptr)
    decay = tl.load(decay_ptr)
    if HAS_OK:
        decay = tl.where(tl.load(ok_ptr).to(tl.int32) != 0, decay, 1.0)

    w_ptrs = w_ptr + batch * s_wb + rows[:, None].to(tl.int64) * s_wr + cols64 * s_wc
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    # The reference's roundings, (w * decay) - (lr * u); the launch disables FMA contraction.
    new = w * decay
    # Most tiles hold no selected row (f < 1): they only decay, with no update arithmetic.
    if tl.max(selected.to(tl.int32), axis=0) > 0:
        u = tl.load(u_ptr + batch * s_ub + slot64[:, None] * s_uk + cols64 * s_uc, mask=sel_mask, other=0.0)
        u = u.to(tl.float32)
        if NORMUON:  # the reference's o_hat = (o / (sqrt(v) + eps)) * (||o|| / ||o_hat||)
            den = tl.load(den_ptr + batch * s_db + slot64 * s_dk, mask=selected, other=1.0)
            u = tl.div_rn(u, den[:, None]) * tl.load(scale_ptr + batch)  # IEEE division, as torch
        if HAS_VOID:  # a matrix whose result was not finite gets a zero update (as if O were 0)
            void_rows = tl.zeros([BLOCK_R], dtype=tl.int32) + tl.load(void_ptr + batch).to(tl.int32)
            u = tl.where((void_rows != 0)[:, None], 0.0, u)
        new = tl.where(selected[:, None], new - lr * u, new)
        if DECAY_M:  # error feedback: only the selected momentum rows decay
            m_ptrs = m_ptr + batch * s_mb + rows[:, None].to(tl.int64) * s_mr + cols64 * s_mc
            m = tl.load(m_ptrs, mask=sel_mask, other=0.0).to(tl.float32)
            tl.store(m_ptrs, round_to(m * mu, m_ptr.dtype.element_ty, INTERPRET), mask=sel_mask)
    tl.store(w_ptrs, round_to(new, w_ptr.dtype.element_ty, INTERPRET), mask=mask)


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


def update_rows(
    weight: torch.Tensor,
    momentum: torch.Tensor | None,
    update: torch.Tensor,
    slot: torch.Tensor | None,
    lr: torch.Tensor,
    decay: torch.Tensor,
    mu: float,
    row_denominator: torch.Tensor | None = None,
    matrix_scale: torch.Tensor | None = None,
    ok: torch.Tensor | None = None,
    void: torch.Tensor | None = None,
) -> None:
    """In place on weight and momentum (B, R, C) views: every weight row times ``decay``; the
    selected rows (``slot`` from ``row_slots``; None: every row, update row r for weight row r)
    minus ``lr * U``, one rounding; their momentum rows times ``mu`` (skipped when momentum is
    None). U = update (B, k, C+) in float32, or with ``row_denominator`` (B, k) and
    ``matrix_scale`` (B,) the NorMuon form (update / denominator) * scale. ``lr``, ``decay``
    and ``ok`` (nonzero: apply) are 0-dim device tensors, read live under graph replay.
    ``void`` (B,) bool: matrices whose U counts as zero (decay and error feedback still run)."""
    B, R, C = weight.shape
    if momentum is not None and momentum.shape != weight.shape:
        raise ValueError(f"update_rows: momentum {tuple(momentum.shape)} != weight {tuple(weight.shape)}")
    k = R if slot is None else update.shape[1]
    if update.shape[0] != B or update.shape[1] < (R if slot is None else 0) or update.shape[2] < C:
        raise ValueError(f"update_rows: update {tuple(update.shape)} does not cover weight {tuple(weight.shape)}")
    if slot is not None and slot.shape != (B, R):
        raise ValueError(f"update_rows: slot must be ({B}, {R}), got {tuple(slot.shape)}")
    normuon = row_denominator is not None
    if normuon and (matrix_scale is None or row_denominator.shape[:2] != (B, k) or matrix_scale.shape != (B,)):
        raise ValueError("update_rows: NorMuon needs row_denominator (B, k) and matrix_scale (B,)")
    if B == 0 or R == 0 or C == 0:
        return
    if ok is not None and ok.dtype == torch.bool:
        ok = ok.view(torch.uint8)  # same byte, a dtype every Triton loads
    if void is not None:
        if void.shape != (B,):
            raise ValueError(f"update_rows: void must be ({B},), got {tuple(void.shape)}")
        void = void.contiguous().view(torch.uint8) if void.dtype == torch.bool else void.contiguous()
    views = [weight] if momentum is None else [weight, momentum]
    block_r, block_c, warps = _tiles("update", *views)
    block_c = min(block_c, triton.next_power_of_2(C))
    m_arg, m_strides = (momentum, momentum.stride()) if momentum is not None else (weight, (0, 0, 0))
    grid = (B, triton.cdiv(R, block_r), triton.cdiv(C, block_c))
    _update_rows_kernel[grid](
        weight,
        m_arg,
        update,
        slot if slot is not None else lr,
        lr,
        decay,
        row_denominator if normuon else lr,
        matrix_scale if normuon else lr,
        ok if ok is not None else lr,
        void if void is not None else lr,
        float(mu),
        R,
        C,
        *weight.stride(),
        *m_strides,
        *update.stride(),
        *(slot.stride() if slot is not None else (0, 0)),
        *(row_denominator.stride() if normuon else (0, 0)),
        EVERY=slot is None,
        NORMUON=normuon,
        HAS_OK=ok is not None,
        HAS_VOID=void is not None,
        DECAY_M=momentum is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        INTERPRET=interpreting(),
        num_warps=warps,
        enable_fp_fusion=False,
    )
