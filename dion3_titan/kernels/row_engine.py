"""The row engine's Triton kernels: the memory-bound passes of a Dion3 step, each byte once.

At f < 1 a step is a small Newton-Schulz wrapped in passes over float32 momentum and weights.
Three kernels cover those passes, each launched once for a whole shape group: every member's
(B, R, C) view (any strides: row-major, transposed for column selection, strided pieces, 3D
stacks) is one operand, described per matrix in a small device table (``Operand``), so one grid
covers all members and the launch count of a step does not grow with the number of layers.

* ``accumulate_scores``: M += G, and each row's l1 norm (selection) and sum of squares (so the
  Frobenius norm of the selected rows needs no second read of M), in one pass; where every row
  is selected (f = 1) also the error feedback M *= mu, so no later pass writes M.
* ``gather_rows``: the selected rows of M straight into the zero-padded Newton-Schulz batch or
  send buffer, divided by a per-matrix denominator (the normalization) and cast once, and
  M[sel] *= mu (error feedback) while those rows are in registers; also NorMuon's per-row
  second moment of the selected rows.
* ``update_rows``: W <- decay * W on every row (without weight decay, the selected rows alone
  are read and written), W[sel] -= lr * lr_scale * U with one rounding, the NorMuon epilogue
  U = (O / d_row) * s_matrix, and the new second moment of the selected rows, in one pass
  (it can also apply the error feedback, for a caller whose gather did not).

The arithmetic follows the torch reference path operation for operation (no FMA contraction),
so float32 state comes out bit-identical where the reference rounds once. Everything here runs
under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests check it there).

Operand tables hold element offsets from a base tensor (the first present view), not raw
addresses: the kernel takes the base as an ordinary pointer argument, which Triton's
interpreter and every Triton version handle alike, and the table of a single tensor depends
only on its shape and strides (the same table serves every step's fresh buffers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import triton
import triton.language as tl

from dion3_titan.kernels.backend import interpreting
from dion3_titan.kernels.launch import cdiv, launch, next_power_of_2
from dion3_titan.kernels.rounding import round_to

# (BLOCK_R, BLOCK_C, num_warps) per kernel when every view's columns are contiguous (wide row
# tiles), and for views that run along rows (transposed: square tiles keep loads coalesced).
# scripts/bench_row_engine.py measures the candidates on a GPU.
TILES: dict[str, tuple[int, int, int]] = {
    "accumulate": (1, 2048, 8),
    "gather": (2, 1024, 4),
    "update": (2, 1024, 4),
    "transposed": (64, 64, 4),
}

# Operand layouts (a constexpr of the kernels): which stride is 1 in every view of the operand.
GENERAL, COLS_UNIT, ROWS_UNIT = 0, 1, 2

T = TypeVar("T")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class TableCache:
    """The kernels' device tables, built once and reused: a steady-state step builds nothing
    on the host and copies no table. A key holds everything its table depends on. Beyond
    ``capacity`` the least recently used entry goes, except entries a CUDA-graph capture
    used: the graph reads them on every replay, so they live as long as the cache.

    A table is on the device once ``device_table`` returns, so a kernel on any stream may read
    it (with ``ns_overlap`` a table built on one stream is read on the other). A capture cannot
    copy from the host, so a table missing during a capture is an error: the eager warm-up step
    before a capture builds them all. An evicted table may still be read by kernels queued on
    another stream: eviction waits for the device first (it happens past ``capacity`` only)."""

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, object] = OrderedDict()
        self._captured: dict[Hashable, object] = {}
        self.builds = 0  # tables built so far (tests check a steady step builds none)

    def get(self, key: Hashable, device: torch.device, build: Callable[[], T]) -> T:
        """The entry of ``key``, made by ``build()`` (which calls ``device_table``) if new."""
        capturing = _capturing(device)
        if key in self._captured:
            return self._captured[key]
        if key in self._entries:
            self._entries.move_to_end(key)
            value = self._entries[key]
        else:
            if capturing:
                raise RuntimeError(
                    "row engine: a kernel table is missing during CUDA-graph capture (tables are "
                    "built by an eager step, which must run before every capture)"
                )
            value = build()
            self.builds += 1
            self._entries[key] = value
            if len(self._entries) > self.capacity and device.type == "cuda":
                torch.cuda.synchronize(device)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        if capturing:
            self._captured[key] = value
        return value


_TABLE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def device_table(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A table on ``device``, there when this returns: readable by a kernel on any stream.
    The copy runs on a stream of its own that nothing else uses, so the host waits for the
    copy alone, not for the work queued on the caller's stream (a copy queued there would reach
    the device only after that work, while a kernel on another stream might read the table
    before). Its memory comes from that stream's pool: no block whose last use is still queued
    on another stream is handed to it."""
    host = torch.tensor(values, dtype=dtype, device="cpu")
    if device.type != "cuda":
        return host.to(device)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _TABLE_STREAMS:
        _TABLE_STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(_TABLE_STREAMS[device]):
        out = torch.empty(host.shape, dtype=dtype, device=device)
        out.copy_(host)  # from pageable memory: returns once the copy is done
    return out


TABLES = TableCache()  # for callers that keep no cache of their own (single tensors, benchmarks)


class KeptViews(tuple):
    """Views a caller keeps, unchanged, from step to step (the optimizer's member views of its
    state and weights, remade only when those tensors are replaced): an operand of them makes
    its table key once per presence pattern and keeps it here, where it dies with the views
    (per-matrix Python is most of an eager step's host time)."""

    def __new__(cls, views):
        kept = super().__new__(cls, views)
        kept.keys = {}  # presence pattern -> the operand's table key
        kept.columns = None  # of (B, R) views: their (B, R, 1) form, kept too (``column_views``)
        return kept


def column_views(views: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """(B, R) views as the (B, R, 1) operand views the kernels take (per-row state), kept with
    ``views`` when they are kept."""
    if not isinstance(views, KeptViews):
        return [v.unsqueeze(-1) for v in views]
    if views.columns is None:
        views.columns = KeptViews(v.unsqueeze(-1) for v in views)
    return views.columns


@dataclass(frozen=True)
class Operand:
    """A launch's views, one kernel argument: ``base`` (the first present view; its pointer)
    and ``table`` (N, 4) int64 on the device, per matrix [offset from the base in elements,
    row stride, column stride, present (0: this matrix has no such view)]."""

    base: torch.Tensor
    table: torch.Tensor
    layout: int  # GENERAL, COLS_UNIT or ROWS_UNIT: the stride that is 1 in every present view
    align: int  # offsets and the other strides are multiples of it (vector loads on a GPU)


def _layout_align(views: list[torch.Tensor], offsets: list[int]) -> tuple[int, int]:
    if all(v.stride(2) == 1 or v.shape[2] == 1 for v in views):
        layout, strides = COLS_UNIT, [v.stride(1) for v in views]
    elif all(v.stride(1) == 1 or v.shape[1] == 1 for v in views):
        layout, strides = ROWS_UNIT, [v.stride(2) for v in views]
    else:
        layout, strides = GENERAL, [s for v in views for s in v.stride()[1:]]
    align = max(1, 16 // views[0].element_size())
    while align > 1 and any(x % align for x in offsets + strides):
        align //= 2
    return layout, align


def operand(
    views: Sequence[torch.Tensor], present: Sequence[bool] | None = None, cache: TableCache = TABLES
) -> Operand:
    """The (B_i, R, C) ``views`` as one operand (all of one dtype and device, same R and C).
    ``present[i]`` False: view i only stands in for its matrices (never read nor written)."""
    here = [True] * len(views) if present is None else [bool(p) for p in present]
    base = next((v for v, p in zip(views, here) if p), views[0])
    kept = views.keys if isinstance(views, KeptViews) else None
    key = kept.get(tuple(here)) if kept is not None else None
    if key is None:
        origin = base.data_ptr()
        # what the table depends on (addresses relative to the base: none for a single tensor)
        # and what the checks in build() read, so a key seen before needs no checking again;
        # one pass, since this runs for every operand of every launch not kept
        key = ("view", base.dtype, base.device, base.stride()) + tuple(
            (v.data_ptr() - origin, v.shape, v.stride(), v.dtype, v.device) if p else (v.shape,)
            for v, p in zip(views, here)
        )
        if kept is not None:
            kept[tuple(here)] = key

    def build() -> tuple[torch.Tensor, int, int]:
        rows, layout, align = _table_rows(views, here, base)
        return device_table(rows, torch.int64, base.device), layout, align

    table, layout, align = cache.get(key, base.device, build)
    return Operand(base, table, layout, align)


def _table_rows(views: Sequence[torch.Tensor], here: list[bool], base: torch.Tensor) -> tuple[list, int, int]:
    """An operand's table rows (one per matrix, offsets from ``base``), layout and alignment."""
    if any(v.dim() != 3 or v.shape[1:] != base.shape[1:] for v in views):
        raise ValueError(f"row engine: views must be (B, R, C) of one R, C: {[tuple(v.shape) for v in views]}")
    if any(p and (v.dtype != base.dtype or v.device != base.device) for v, p in zip(views, here)):
        raise ValueError("row engine: the views of one operand must share dtype and device")
    size, origin = base.element_size(), base.data_ptr()
    rows, offsets = [], []
    for v, p in zip(views, here):
        if not p:  # never dereferenced: zeros (a multiple of any alignment)
            rows += [[0, 0, 0, 0] for _ in range(v.shape[0])]
            continue
        delta, rest = divmod(v.data_ptr() - origin, size)
        if rest:
            raise ValueError("row engine: a view is not aligned to its element size")
        starts = [delta + b * v.stride(0) for b in range(v.shape[0])]
        rows += [[s, v.stride(1), v.stride(2), 1] for s in starts]
        offsets += starts
    live = [v for v, p in zip(views, here) if p]
    layout, align = _layout_align(live or [base], offsets)
    return rows, layout, align


class MovableOperand:
    """An operand whose views may move between launches of a captured CUDA graph: its table is
    its own (never cached) and ``move`` rewrites a view's offsets, so a replayed launch reads
    that view where it is now. The launch keeps the base it was captured with (as an address
    only: every offset is relative to it), so a view keeps its strides when it moves, and the
    distance moved must keep the operand's alignment (``move`` refuses otherwise).

    The table is written by ``flush`` alone, a host-to-device copy that must stay out of any
    capture (a captured copy would rewrite the table from its host buffer at every replay).
    ``table``: where the table lives. A table made inside a capture would come from the
    graph's memory pool, whose blocks the replay may also use for its temporaries, so a
    captured step passes memory allocated before its capture."""

    def __init__(
        self, views: Sequence[torch.Tensor], present: Sequence[bool] | None = None, table: torch.Tensor | None = None
    ) -> None:
        here = [True] * len(views) if present is None else [bool(p) for p in present]
        self.base = next((v for v, p in zip(views, here) if p), views[0])
        self._rows, self.layout, self.align = _table_rows(views, here, self.base)
        self._built = [row[0] for row in self._rows]  # offsets where the views were
        starts = [0]
        for v in views:
            starts.append(starts[-1] + v.shape[0])
        self._spans = [(s, e) if p else None for s, e, p in zip(starts, starts[1:], here)]
        shape = (len(self._rows), 4)
        if table is None:
            table = torch.empty(shape, dtype=torch.int64, device=self.base.device)
        elif table.shape != shape or table.dtype != torch.int64 or table.device != self.base.device:
            raise ValueError(f"row engine: a movable operand needs an int64 table of {shape} on {self.base.device}")
        self.table = table
        self._dirty = True

    @property
    def operand(self) -> Operand:
        return Operand(self.base, self.table, self.layout, self.align)

    def host_table(self) -> torch.Tensor:
        """The table as the next ``flush`` writes it (int64, on the host)."""
        return torch.tensor(self._rows, dtype=torch.int64, device="cpu")

    def can_move(self, index: int, delta_bytes: int) -> bool:
        """Whether view ``index`` (present) may lie ``delta_bytes`` from where it was built."""
        return self._spans[index] is not None and delta_bytes % (self.base.element_size() * self.align) == 0

    def move(self, index: int, delta_bytes: int) -> None:
        """View ``index`` now lies ``delta_bytes`` from where it was built (0: back there), same
        strides; takes effect at the next ``flush``."""
        if not self.can_move(index, delta_bytes):
            raise ValueError(f"row engine: view {index} cannot move by {delta_bytes} bytes (alignment {self.align})")
        start, end = self._spans[index]
        shift = delta_bytes // self.base.element_size()
        for r in range(start, end):
            if self._rows[r][0] != self._built[r] + shift:
                self._rows[r][0] = self._built[r] + shift
                self._dirty = True

    def flush(self) -> None:
        """Write the table where an offset changed: one asynchronous copy on the current stream."""
        if self._dirty:
            if _capturing(self.table.device):
                raise RuntimeError("row engine: a movable operand's table is written outside CUDA-graph captures")
            host = self.host_table()
            self.table.copy_(host.pin_memory() if self.table.is_cuda else host, non_blocking=True)
            self._dirty = False


def _scales(values: Sequence[float], device: torch.device, cache: TableCache) -> torch.Tensor:
    """(N,) float32 per-matrix factors (the members' learning-rate scales), cached."""
    key = ("scales", device, tuple(values))
    return cache.get(key, device, lambda: device_table(list(values), torch.float32, device))


def _flag(t: torch.Tensor | None) -> torch.Tensor | None:
    """A bool device flag as uint8 (same bytes, a dtype every Triton loads)."""
    return t.view(torch.uint8) if t is not None and t.dtype == torch.bool else t


def _tiles(kind: str, *layouts: int) -> tuple[int, int, int]:
    return TILES[kind] if all(x == COLS_UNIT for x in layouts) else TILES["transposed"]


def _tensor_layout(t: torch.Tensor) -> int:
    return COLS_UNIT if t.stride(-1) == 1 or t.shape[-1] == 1 else GENERAL


@triton.jit
def _view(tab, n, LAYOUT: tl.constexpr, ALIGN: tl.constexpr):
    """Matrix n of an operand: (offset from the base, row stride, column stride, present).
    LAYOUT 1 (COLS_UNIT) and 2 (ROWS_UNIT) make that stride the constant 1, and ALIGN tells
    the compiler what the rest are multiples of: what a plain tensor argument's specialization
    would have told it (coalesced, vectorized loads)."""
    entry = tab + n * 4
    off = tl.multiple_of(tl.load(entry), ALIGN)
    if LAYOUT == 2:
        s_r = 1
    else:
        s_r = tl.multiple_of(tl.load(entry + 1), ALIGN)
    if LAYOUT == 1:
        s_c = 1
    else:
        s_c = tl.multiple_of(tl.load(entry + 2), ALIGN)
    return off, s_r, s_c, tl.load(entry + 3)


@triton.jit
def _per_row(x, BLOCK_R: tl.constexpr):
    """A scalar flag broadcast to a (BLOCK_R,) bool vector."""
    return (tl.zeros([BLOCK_R], dtype=tl.int32) + x.to(tl.int32)) != 0


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
    m_off, m_sr, m_sc, _ = _view(m_tab, n, M_LAYOUT, M_ALIGN)
    # elementwise partial sums, reduced once after the loop (no cross-warp reduction per tile)
    l1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    sq = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    if HAS_G:
        # a matrix without a gradient, or a step judged not finite, leaves the momentum as it is
        g_off, g_sr, g_sc, g_here = _view(g_tab, n, G_LAYOUT, G_ALIGN)
        add = _per_row(g_here, BLOCK_R)
        if HAS_OK:
            add = add & _per_row(tl.load(ok_ptr), BLOCK_R)
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
    block_r, block_c, warps = _tiles("accumulate", mo.layout, go.layout)
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
        _flag(ok) if ok is not None else l1,
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


@triton.jit
def _normuon_factors_kernel(
    rowsq_ptr,
    v_ptr,
    void_ptr,
    den_ptr,
    v_new_ptr,
    scale_ptr,
    K,
    stride_v0,
    stride_v1,
    beta2,
    one_minus_beta2,
    cols,
    eps,
    tiny,
    HAS_VOID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per matrix n: from its rows' sums of squares (n, K) and second moments,
    the new second moments, the rows' denominators sqrt(v_new) + eps and the matrix scale
    ||o|| / ||o_hat||, in the reference's order of operations (normuon_factors)."""
    n = tl.program_id(0)
    voided = False
    if HAS_VOID:
        voided = tl.load(void_ptr + n) != 0
    sum_o = tl.zeros([BLOCK], dtype=tl.float32)
    sum_hat = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < K
        rs = tl.load(rowsq_ptr + n * K + offs, mask=mask, other=0.0)
        if HAS_VOID:
            rs = tl.where(voided, 0.0, rs)
        v = tl.load(v_ptr + n * stride_v0 + offs * stride_v1, mask=mask, other=0.0).to(tl.float32)
        v_new = v * beta2 + (one_minus_beta2 * rs) / cols
        den = tl.sqrt_rn(v_new) + eps
        tl.store(den_ptr + n * K + offs, den, mask=mask)
        tl.store(v_new_ptr + n * K + offs, v_new, mask=mask)
        sum_o += rs
        sum_hat += tl.where(mask, rs / (den * den), 0.0)
    norm_hat = tl.maximum(tl.sqrt_rn(tl.sum(sum_hat, axis=0)), tiny)
    tl.store(scale_ptr + n, tl.sqrt_rn(tl.sum(sum_o, axis=0)) / norm_hat)


def normuon_factors(
    rowsq: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, cols: int, void: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NorMuon's factors from the rows' sums of squares ``rowsq`` (N, K) of the NS result and
    their second moments ``v`` (N, K): (denominators (N, K), matrix scales (N,), new second
    moments (N, K)), float32, in one launch. ``void`` (N,) bool: matrices taken as zero."""
    N, K = rowsq.shape
    if v.shape != (N, K) or not rowsq.is_contiguous():
        raise ValueError(f"normuon_factors: rowsq must be contiguous (N, K) and v {(N, K)}, got {tuple(v.shape)}")
    den = torch.empty_like(rowsq)
    v_new = torch.empty_like(rowsq)
    scale = torch.empty(N, dtype=torch.float32, device=rowsq.device)
    if N == 0:
        return den, scale, v_new
    block = min(1024, next_power_of_2(max(K, 1)))
    launch(
        _normuon_factors_kernel,
        (N,),
        rowsq,
        v,
        _flag(void.contiguous()) if void is not None else rowsq,
        den,
        v_new,
        scale,
        K,
        *v.stride(),
        float(beta2),
        1.0 - beta2,
        float(cols),
        float(eps),
        torch.finfo(torch.float32).tiny,
        HAS_VOID=void is not None,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return den, scale, v_new


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
    m_off, m_sr, m_sc, active = _view(m_tab, n, M_LAYOUT, M_ALIGN)
    live = (j < num_sel) & _per_row(active, BLOCK_R)  # an inactive matrix is all zeros
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
            decays = decays & _per_row(tl.load(ok_ptr), BLOCK_R)[:, None]
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
    block_r, block_c, warps = _tiles("gather", mo.layout, _tensor_layout(out))
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
        _flag(ok) if ok is not None else out,
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
    w_off, w_sr, w_sc, active = _view(w_tab, n, W_LAYOUT, W_ALIGN)
    if BY_SLOT:  # the programs walk the selected rows: slot_ptr[n, s] is slot s's row (-1: none)
        slot = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_k = (slot < num_slots) & _per_row(active, BLOCK_R)
        picked = tl.load(slot_ptr + n * s_sb + slot * s_sr, mask=in_k, other=-1)
        row_ok = in_k & (picked >= 0)
        rows = tl.maximum(picked, 0).to(tl.int32)
    else:  # the programs walk every row
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = (rows < num_rows) & _per_row(active, BLOCK_R)  # an inactive matrix is left as it is
        if EVERY:
            slot = rows
        else:  # slot[n, r]: position of row r among the selected rows, -1 if not selected
            slot = tl.load(slot_ptr + n * s_sb + rows * s_sr, mask=row_ok, other=-1)
    selected = row_ok & (slot >= 0)
    if HAS_OK:  # a step judged not finite leaves weights, momentum and row state as they are
        selected = selected & _per_row(tl.load(ok_ptr), BLOCK_R)
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
                u = tl.where(_per_row(tl.load(void_ptr + n), BLOCK_R)[:, None], 0.0, u)
            new = tl.where(selected[:, None], new - lr * u, new)
            if DECAY_M:  # error feedback: only the selected momentum rows decay
                m_off, m_sr, m_sc, _ = _view(m_tab, n, M_LAYOUT, M_ALIGN)
                m_ptrs = m_ptr + m_off + rows64 * m_sr + cols64 * m_sc
                m = tl.load(m_ptrs, mask=sel_mask, other=0.0).to(tl.float32)
                tl.store(m_ptrs, round_to(m * mu, m_ptr.dtype.element_ty, INTERPRET), mask=sel_mask)
            if HAS_V:  # NorMuon's new second moment of the selected rows, by the first column block
                v_sel = selected & _per_row(tl.program_id(2) == 0, BLOCK_R)
                v_off, v_sr, _, _ = _view(v_tab, n, 1, 1)  # (B, R, 1) views: the column is 0
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
        scales = _scales([s for w, s in zip(weights, lr_scales) for _ in range(w.shape[0])], lr.device, cache)
    void = _flag(void.contiguous()) if void is not None else None
    block_r, block_c, warps = _tiles("update", wo.layout, mo.layout)
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
        _flag(ok) if ok is not None else lr,
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
    block_r, block_c, warps = _tiles("update", wo.layout, wo.layout)
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
        _flag(ok) if ok is not None else decay,
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
