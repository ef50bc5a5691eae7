"""The row engine's operands: a shape group's views as one kernel argument (a base tensor and a
small device table per matrix), the tables' cache, and the helpers every row-engine kernel
uses to read them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import triton
import triton.language as tl

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


def scales_table(values: Sequence[float], device: torch.device, cache: TableCache) -> torch.Tensor:
    """(N,) float32 per-matrix factors (the members' learning-rate scales), cached."""
    key = ("scales", device, tuple(values))
    return cache.get(key, device, lambda: device_table(list(values), torch.float32, device))


def as_flag(t: torch.Tensor | None) -> torch.Tensor | None:
    """A bool device flag as uint8 (same bytes, a dtype every Triton loads)."""
    return t.view(torch.uint8) if t is not None and t.dtype == torch.bool else t


def tiles_for(kind: str, *layouts: int) -> tuple[int, int, int]:
    """The (BLOCK_R, BLOCK_C, num_warps) of a ``kind`` pass over operands of these layouts."""
    return TILES[kind] if all(x == COLS_UNIT for x in layouts) else TILES["transposed"]


def tensor_layout(t: torch.Tensor) -> int:
    """The layout of a single tensor taken as an operand (COLS_UNIT or GENERAL)."""
    return COLS_UNIT if t.stride(-1) == 1 or t.shape[-1] == 1 else GENERAL


@triton.jit
def matrix_view(tab, n, LAYOUT: tl.constexpr, ALIGN: tl.constexpr):
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
def per_row(x, BLOCK_R: tl.constexpr):
    """A scalar flag broadcast to a (BLOCK_R,) bool vector."""
    return (tl.zeros([BLOCK_R], dtype=tl.int32) + x.to(tl.int32)) != 0
