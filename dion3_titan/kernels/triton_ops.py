"""Triton backend: a symmetric batched GEMM and the fused weight update.

Symmetric GEMM. For (L, n, k) @ (L, k, n) whose product is symmetric (X X^T, b R + c R^2, ...)
only the output tiles on or below the diagonal are computed: T(T+1)/2 of the T^2 tiles for
T = ceil(n / BLOCK). Each off-diagonal tile is stored twice, at (i, j) and transposed at (j, i);
a diagonal tile replaces its upper triangle by the transpose of its lower one before its store. So the
result is exactly symmetric by construction: no element relies on the dot accumulating (i, j)
and (j, i) in the same order (Triton's CPU interpreter does not). That halves the FLOPs of the
product and leaves the bytes written unchanged.

Fused update. One pass over the weight: every row is scaled by ``decay``; rows listed in ``rows``
also get ``- lr * update``; float32 math and one rounding to the weight's dtype, exactly as
``torch_ops._fused_update_reference`` computes it (same operations, same order, no FMA). The
kernel is the row engine's (row_engine.update_rows, without momentum).

Everything here also runs under ``TRITON_INTERPRET=1`` on CPU tensors (that is how the CPU tests
check the kernels' logic). ``mm``/``mm_add`` are cuBLAS products unless triton_mm's switches send
them to its persistent GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dion3_titan.kernels import triton_mm
from dion3_titan.kernels.backend import interpreting, norm_denominator, normalized_buffer
from dion3_titan.kernels.launch import cdiv, launch, next_power_of_2
from dion3_titan.kernels.rounding import round_to
from dion3_titan.kernels.row_engine import gather_rows, row_slots, update_rows
from dion3_titan.kernels.tma import (
    aligned,
    ensure_scratch_allocator,
    grid_sms,
    launch_or_none,
    mma_step,
    num_sms,
    operand_descs,
    rows_stacked,
    stacked_desc,
)
from dion3_titan.kernels.torch_ops import TorchOps

# One tile shape for all sizes; chosen from measured configs (docs/kernels.md).
# (BLOCK, BLOCK_K, GROUP, num_warps, num_stages)
SYM_CONFIG: tuple[int, int, int, int, int] = (128, 64, 8, 8, 3)
_SUPPORTED = (torch.float16, torch.bfloat16)


@triton.jit
def _lower_tile(t, num_tiles_side, GROUP: tl.constexpr):
    """Linear index t -> (row i, col j) of a lower-triangle tile, j <= i.

    Tiles are visited in bands of GROUP tile rows. Within a band the rectangle left of the
    band's own diagonal block goes column by column, so the programs running together share
    their B panels (and the band's A panels) in L2; the small triangle at the band's right end
    goes row by row. Row-major order of the whole triangle has the same tile count before each
    band, so the band is found from the row-major row of t.
    """
    # row-major triangle row: largest r with r(r+1)/2 <= t (float sqrt, then fixed up exactly)
    r = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    r = tl.where((r + 1) * (r + 2) // 2 <= t, r + 1, r)
    r = tl.where(r * (r + 1) // 2 > t, r - 1, r)
    band_start = (r // GROUP) * GROUP
    band_rows = tl.minimum(num_tiles_side - band_start, GROUP)
    local = t - band_start * (band_start + 1) // 2  # index inside the band
    rect = band_rows * band_start  # tiles in the band's rectangle (columns < band_start)
    # rectangle, column-major
    i_rect = band_start + local % band_rows
    j_rect = local // band_rows
    # small triangle, row-major
    u = tl.maximum(local - rect, 0)
    q = ((tl.sqrt((8 * u + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    q = tl.where((q + 1) * (q + 2) // 2 <= u, q + 1, q)
    q = tl.where(q * (q + 1) // 2 > u, q - 1, q)
    i_tri = band_start + q
    j_tri = band_start + u - q * (q + 1) // 2
    in_rect = local < rect
    return tl.where(in_rect, i_rect, i_tri), tl.where(in_rect, j_rect, j_tri)


@triton.jit
def _sym_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    n,
    k,
    s_ab,
    s_am,
    s_ak,
    s_bb,
    s_bk,
    s_bn,
    s_cb,
    s_cm,
    s_cn,
    s_ob,
    s_om,
    s_on,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_tiles_side = tl.cdiv(n, BLOCK)
    ti, tj = _lower_tile(t, num_tiles_side, GROUP)

    rows = ti * BLOCK + tl.arange(0, BLOCK)
    cols = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    # In-matrix offsets stay plain int32 aranges (no clamping, no casts): that is what lets the
    # compiler see the unit-stride dim as contiguous and issue 16-byte async copies for either
    # operand layout. (A tl.where-clamped index turned n-major B loads into scalar 2-byte loads:
    # Gram NS ran 3-5x slower than on cuBLAS, docs/kernels.md.) The batch offset is int64.
    a_ptrs = a_ptr + batch * s_ab + rows[:, None] * s_am + ks[None, :] * s_ak
    b_ptrs = b_ptr + batch * s_bb + ks[:, None] * s_bk + cols[None, :] * s_bn

    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for kk in range(0, tl.cdiv(k, BLOCK_K)):
        if EVEN_K and EVEN_N:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = k - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=(rows[:, None] < n) & (ks[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] < k_left) & (cols[None, :] < n), other=0.0)
        if INTERPRET:
            # the interpreter's bf16 dot multiplies the raw bits; fp32 products of the
            # (exactly upcast) inputs give the same fp32-accumulated result
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    if HAS_C:
        # torch.baddbmm's order: alpha * (a @ b) + beta * c, in float32
        c_ptrs = c_ptr + batch * s_cb + rows[:, None] * s_cm + cols[None, :] * s_cn
        c_mask = (rows[:, None] < n) & (cols[None, :] < n)
        c = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        acc = alpha * acc + beta * c
    else:
        acc = alpha * acc

    res = round_to(acc, out_ptr.dtype.element_ty, INTERPRET)
    out_base = out_ptr + batch * s_ob
    if ti == tj:  # the lower triangle and its mirror: exactly symmetric by construction
        res = tl.where(rows[:, None] >= cols[None, :], res, tl.trans(res))
    mask = (rows[:, None] < n) & (cols[None, :] < n)
    tl.store(out_base + rows[:, None] * s_om + cols[None, :] * s_on, res, mask=mask)
    if ti != tj:
        mask_t = (cols[:, None] < n) & (rows[None, :] < n)
        tl.store(out_base + cols[:, None] * s_om + rows[None, :] * s_on, tl.trans(res), mask=mask_t)


@triton.jit
def _isqrt(t):
    """floor(sqrt(t)) of a non-negative int32 (float sqrt, then fixed up exactly)."""
    s = tl.sqrt(t.to(tl.float32)).to(tl.int32)
    s = tl.where((s + 1) * (s + 1) <= t, s + 1, s)
    return tl.where(s * s > t, s - 1, s)


@triton.jit
def _pairs_before(r):
    """Wide tiles in tile rows 0..r-1: row i holds i // 2 + 1 of them (pair columns 0..i // 2)."""
    q = r // 2
    return tl.where(r % 2 == 0, q * (q + 1), (q + 1) * (q + 1))


@triton.jit
def _pairs_row(t):
    """The tile row of row-major wide tile t: the largest r with _pairs_before(r) <= t. Rows
    2q - 1 and 2q start at q^2 and q(q + 1), so it follows from s = isqrt(t)."""
    s = _isqrt(t)
    return tl.where(t < s * (s + 1), 2 * s - 1, 2 * s)


@triton.jit
def _wide_lower_tile(t, num_tiles_side, GROUP: tl.constexpr):
    """Linear index t -> (tile row i, pair column p) of a wide tile: BLOCK rows by 2 * BLOCK
    columns, the tile blocks (i, 2p) and (i, 2p + 1), for p <= i // 2. Block (i, 2p + 1) lies
    above the diagonal when i is even (2p = i); it is computed and dropped (T / 2 of the
    T(T + 1) / 2 blocks). Bands of GROUP (even) tile rows as in ``_lower_tile``: the band's
    rectangle column by column, then its triangle row by row."""
    band_start = (_pairs_row(t) // GROUP) * GROUP
    band_rows = tl.minimum(num_tiles_side - band_start, GROUP)
    local = t - _pairs_before(band_start)
    half = band_start // 2  # pair columns left of the band's diagonal blocks
    rect = band_rows * half
    u = tl.maximum(local - rect, 0)
    r_tri = _pairs_row(u)
    in_rect = local < rect
    i = tl.where(in_rect, band_start + local % band_rows, band_start + r_tri)
    p = tl.where(in_rect, local // band_rows, half + u - _pairs_before(r_tri))
    return i, p


@triton.jit
def _store_sym_block(
    acc,
    c_desc,
    out_desc,
    batch,
    n,
    ti,
    tj,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Lower block (ti, tj), tj <= ti, of the result: alpha * acc + beta * C (torch.baddbmm's
    order, in float32), rounded, stored at (ti, tj) and transposed at (tj, ti); a diagonal block
    takes the transpose of its lower triangle as its upper one (see _sym_gemm_kernel)."""
    row, col = batch * n + ti * BLOCK, tj * BLOCK
    if HAS_C:
        acc = alpha * acc + beta * c_desc.load([row, col]).to(tl.float32)
    else:
        acc = alpha * acc
    res = round_to(acc, out_desc.dtype, INTERPRET)
    if ti == tj:
        r = tl.arange(0, BLOCK)
        res = tl.where(r[:, None] >= r[None, :], res, tl.trans(res))
    out_desc.store([row, col], res)
    if ti != tj:
        out_desc.store([batch * n + tj * BLOCK, ti * BLOCK], tl.trans(res))


@triton.jit
def _sym_gemm_tma_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    n,
    k,
    L,
    alpha,
    beta,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    HAS_C: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    WS: tl.constexpr,
    WIDE: tl.constexpr,
    NUM_SMS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Persistent form of ``_sym_gemm_kernel`` for n % BLOCK == 0 and k % BLOCK_K == 0: one
    program per SM walks the lower tiles of every matrix; operands come in by TMA from 2D views
    that stack the batch along rows (descriptors built here, tma.stacked_desc), so a tile never
    straddles two matrices. ``A_T``/``B_T``:
    the operand's unit stride is its row dim, and the descriptor holds its transpose. ``WS``:
    Triton's automatic warp specialization of the tile loop (see triton_mm.Config). ``WIDE``:
    each product tile is BLOCK x 2 BLOCK (``_wide_lower_tile``), the tile shape at which a
    Hopper warpgroup's MMA reads the least shared memory per FLOP; its two blocks are finished
    and stored one after the other."""
    side = n // BLOCK
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, n, n, k, L, BLOCK, 2 * BLOCK if WIDE else BLOCK, BLOCK_K, A_T, B_T)
    out_desc = stacked_desc(out_ptr, L * n, n, BLOCK, BLOCK)
    if HAS_C:
        c_desc = stacked_desc(c_ptr, L * n, n, BLOCK, BLOCK)
    else:
        c_desc = out_desc
    if WIDE:
        per_matrix = _pairs_before(side)
    else:
        per_matrix = side * (side + 1) // 2
    k_tiles = k // BLOCK_K
    for tile in tl.range(tl.program_id(0), L * per_matrix, NUM_SMS, warp_specialize=WS):
        batch = tile // per_matrix
        if WIDE:
            ti, tp = _wide_lower_tile(tile % per_matrix, side, GROUP)
            acc = tl.zeros((BLOCK, 2 * BLOCK), dtype=tl.float32)
            for kk in range(k_tiles):
                acc = mma_step(
                    acc, a_desc, b_desc, batch, ti, tp, kk, n, n, k, BLOCK, 2 * BLOCK, BLOCK_K, A_T, B_T, INTERPRET
                )
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK, 2, BLOCK)), (0, 2, 1)))
            _store_sym_block(left, c_desc, out_desc, batch, n, ti, 2 * tp, alpha, beta, HAS_C, BLOCK, INTERPRET)
            if 2 * tp + 1 <= ti:
                _store_sym_block(
                    right, c_desc, out_desc, batch, n, ti, 2 * tp + 1, alpha, beta, HAS_C, BLOCK, INTERPRET
                )
        else:
            ti, tj = _lower_tile(tile % per_matrix, side, GROUP)
            acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
            for kk in range(k_tiles):
                acc = mma_step(
                    acc, a_desc, b_desc, batch, ti, tj, kk, n, n, k, BLOCK, BLOCK, BLOCK_K, A_T, B_T, INTERPRET
                )
            _store_sym_block(acc, c_desc, out_desc, batch, n, ti, tj, alpha, beta, HAS_C, BLOCK, INTERPRET)


@triton.jit
def _tile_order_kernel(out_ptr, count, side, GROUP: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    if WIDE:
        i, j = _wide_lower_tile(t, side, GROUP)
    else:
        i, j = _lower_tile(t, side, GROUP)
    tl.store(out_ptr + 2 * t, i, mask=t < count)
    tl.store(out_ptr + 2 * t + 1, j, mask=t < count)


def wide_tiles(side: int) -> int:
    """Wide tiles (BLOCK x 2 BLOCK) per matrix of ``side`` tile rows: row i holds i // 2 + 1."""
    q = side // 2
    return q * (q + 1) if side % 2 == 0 else (q + 1) ** 2


def tile_order(side: int, group: int, device: torch.device | str = "cpu", wide: bool = False) -> torch.Tensor:
    """(count, 2) int32: the (row, col) tile each program of the symmetric GEMM computes, in
    launch order, for ``side`` = T tiles per side (for tests and for reading the schedule):
    T(T+1)/2 square tiles, or with ``wide`` the (row, pair column) of ``wide_tiles(T)`` wide ones."""
    count = wide_tiles(side) if wide else side * (side + 1) // 2
    out = torch.full((count, 2), -1, dtype=torch.int32, device=device)
    _tile_order_kernel[(1,)](out, count, side, GROUP=group, WIDE=wide, BLOCK=next_power_of_2(count))
    return out


def _check_sym_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"sym_mm expects batched (L, n, k) @ (L, k, n); got {tuple(a.shape)} @ {tuple(b.shape)}")
    L, n, k = a.shape
    if b.shape != (L, k, n):
        raise ValueError(f"sym_mm expects b of shape {(L, k, n)}; got {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"sym_mm expects matching dtypes; got {a.dtype} and {b.dtype}")
    return L, n, k


def _offsets_fit(n: int, k: int) -> bool:
    """In-matrix offsets are int32 (see the kernel); the batch offset is int64."""
    return n * max(n, k) < 2**31


def sym_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    config: tuple[int, int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """alpha * (a @ b) + beta * c for a symmetric result, fp16/bf16, any strides.

    ``config`` = (BLOCK, BLOCK_K, GROUP, num_warps, num_stages) overrides ``SYM_CONFIG`` (benchmarks);
    ``out`` (L, n, n) receives the result (tests pass a NaN-filled one to see every element written).
    """
    L, n, k = _check_sym_operands(a, b)
    if config is None and TMA_CONFIG is not None and a.is_cuda and tma_pays(L, n, k, num_sms(a.device)):
        # one fallback record per compiled variant: a config may fit shared memory without C only
        cfg = tma_config(n)
        key = ("sym_gemm_tma", cfg, c is not None and beta != 0.0)
        done = launch_or_none(key, lambda: sym_gemm_tma(a, b, c, alpha, beta, config=cfg, out=out))
        if done is not None:
            return done
    if not _offsets_fit(n, k):
        raise ValueError(f"sym_gemm: one matrix of n={n}, k={k} exceeds int32 offsets")
    block, block_k, group, num_warps, num_stages = config or SYM_CONFIG
    if out is None:
        out = torch.empty((L, n, n), dtype=a.dtype, device=a.device)
    if L == 0 or n == 0:
        return out
    if k == 0:  # empty product: only the C term remains
        return out.copy_(beta * c if c is not None else torch.zeros_like(out))
    has_c = c is not None and beta != 0.0
    if has_c:
        assert c is not None
        if c.shape != (L, n, n):
            raise ValueError(f"sym_addmm expects c of shape {(L, n, n)}; got {tuple(c.shape)}")
        c_arg, c_strides = c, c.stride()
    else:
        c_arg, c_strides = out, (0, 0, 0)  # never read
    side = cdiv(n, block)
    grid = (side * (side + 1) // 2, L)
    launch(
        _sym_gemm_kernel,
        grid,
        a,
        b,
        c_arg,
        out,
        n,
        k,
        *a.stride(),
        *b.stride(),
        *c_strides,
        *out.stride(),
        float(alpha),
        float(beta),
        HAS_C=has_c,
        EVEN_K=(k % block_k == 0),
        EVEN_N=(n % block == 0),
        BLOCK=block,
        BLOCK_K=block_k,
        GROUP=group,
        INTERPRET=interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


class TmaConfig(NamedTuple):
    """A config of the persistent symmetric kernel: SYM_CONFIG's fields, then ``ws`` (Triton's
    warp specialization of the tile loop) and ``wide`` (BLOCK x 2 BLOCK product tiles, which
    needs an even GROUP)."""

    block: int
    block_k: int
    group: int
    num_warps: int
    num_stages: int
    ws: bool = False
    wide: bool = False


# What sym_gemm runs the persistent kernel with (measured: docs/benchmarks.md, "Wide symmetric
# tiles"); TMA_CONFIG None turns the kernel off. Wide tiles from TMA_WIDE_MIN_N rows: measured
# 1.5-5% faster at n = 2816 and 8192, 3-4% slower at 2048 and 9% at 1024, where the dropped
# block above each even row's diagonal (1 / (T + 1) of the work) and fewer tiles per SM weigh more.
TMA_CONFIG: TmaConfig | None = TmaConfig(128, 64, 8, 8, 4)
TMA_WIDE_CONFIG: TmaConfig | None = TmaConfig(128, 64, 8, 8, 3, wide=True)
TMA_WIDE_MIN_N = 2816


def tma_config(n: int) -> TmaConfig:
    """The persistent kernel's config for a result of n x n (TMA_CONFIG must be set)."""
    if TMA_WIDE_CONFIG is not None and n >= TMA_WIDE_MIN_N:
        return TMA_WIDE_CONFIG
    return TMA_CONFIG


TMA_MIN_KSTEPS_PER_SM = 200


def tma_pays(L: int, n: int, k: int, sms: int) -> bool:
    """Whether ``sym_gemm`` takes the persistent kernel for L products (n x k) @ (k x n)."""
    block, block_k = TMA_CONFIG.block, TMA_CONFIG.block_k
    side = cdiv(n, block)
    return L * side * (side + 1) // 2 * cdiv(k, block_k) >= TMA_MIN_KSTEPS_PER_SM * sms


def sym_gemm_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    config: tuple | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``sym_gemm`` through the persistent TMA kernel, or None when the operands do not fit it
    (n % BLOCK, k % BLOCK_K, an operand without a unit-stride dim, a non-contiguous C or out,
    misaligned storage): the caller then uses the general kernel. ``config``: a ``TmaConfig``
    (or a tuple of its fields) in place of TMA_CONFIG."""
    L, n, k = _check_sym_operands(a, b)
    cfg = config if isinstance(config, TmaConfig) else TmaConfig(*(config or TMA_CONFIG))  # sym_gemm passes one
    block, block_k = cfg.block, cfg.block_k
    if cfg.wide and cfg.group % 2:
        raise ValueError(f"sym_gemm_tma: a wide config needs an even GROUP; got config={tuple(cfg)}")
    has_c = c is not None and beta != 0.0
    sa, sb = rows_stacked(a), rows_stacked(b)
    if (
        L == 0
        or n == 0
        or k == 0
        or n % block
        or k % block_k
        or sa is None
        or sb is None
        or (out is not None and not out.is_contiguous())
        or (has_c and (c.shape != (L, n, n) or not c.is_contiguous()))
        or not aligned(a, b, c if has_c else None, out)
    ):
        return None
    if out is None:
        out = torch.empty((L, n, n), dtype=a.dtype, device=a.device)
    ensure_scratch_allocator()
    sms = grid_sms(a.device)
    side = n // block
    tiles = wide_tiles(side) if cfg.wide else side * (side + 1) // 2
    grid = (min(sms, L * tiles),)
    launch(
        _sym_gemm_tma_kernel,
        grid,
        sa[0],
        sb[0],
        c if has_c else out,
        out,
        n,
        k,
        L,
        float(alpha),
        float(beta),
        A_T=sa[1],
        B_T=sb[1],
        HAS_C=has_c,
        BLOCK=block,
        BLOCK_K=block_k,
        GROUP=cfg.group,
        WS=cfg.ws,
        WIDE=cfg.wide,
        NUM_SMS=sms,
        INTERPRET=interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fused_update(
    weight: torch.Tensor,
    update: torch.Tensor,
    rows: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
) -> None:
    """See ``Backend.fused_update``: the row engine's update kernel without momentum (one
    kernel owns the update's arithmetic). No host sync: lr/decay are read on the device."""
    B, R, C = weight.shape
    k = rows.shape[1]
    if update.shape != (B, k, C):
        raise ValueError(f"fused_update expects update of shape {(B, k, C)}; got {tuple(update.shape)}")
    update_rows(weight, None, update, row_slots(rows, R), lr, decay, mu=1.0)


class TritonOps(TorchOps):
    """Symmetric products, the fused update and (where MM_CONFIG / MM_ADD_CONFIG switch it on)
    general products in Triton; the rest (and dtypes the kernels do not take) through the torch
    backend."""

    name = "triton"

    def gram_side(self, n: int) -> int:
        # whole tiles: the persistent TMA kernel takes only sides that are a multiple of its
        # block (docs/benchmarks.md, "Padding the Gram side")
        block = TMA_CONFIG.block if TMA_CONFIG is not None else 1
        return n if n <= block else cdiv(n, block) * block

    def normalize(self, x: torch.Tensor, eps: float, dtype: torch.dtype, side: int) -> torch.Tensor:
        # one pass that divides, rounds and writes the zero rows (the row engine's gather, as
        # the optimizer's step packs its batches): torch's mixed-dtype division and a padding
        # copy took 0.6-1.3 ms per batch at 32x2048x2048 and 16x2752x4096 on one H200
        if x.dtype == torch.float64 or not (x.is_cuda or interpreting()):
            return super().normalize(x, eps, dtype, side)
        out = normalized_buffer(x, dtype, side)
        gather_rows(x, None, out, denominator=norm_denominator(x, eps).view(-1))
        return out

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        result = self._mm(a, b, None, 1.0, 0.0, out=out)
        return result if result is not None else super().mm(a, b, out)

    def mm_add(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        alpha: float,
        beta: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result = self._mm(a, b, c, alpha, beta, out=out)
        return result if result is not None else super().mm_add(a, b, c, alpha, beta, out)

    def mm_checked(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor | None,
        alpha: float,
        beta: float,
        flags: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        # where mm / mm_add would run the TMA GEMM (not cuBLAS): the check rides on its epilogue
        return self._mm(a, b, c, alpha, beta, flags, out)

    def _mm(self, a, b, c, alpha, beta, flags=None, out=None) -> torch.Tensor | None:
        """The persistent TMA GEMM where it is switched on (MM_CONFIG for A B, ``add_config``
        with C) and the operands fit it; None sends the product to cuBLAS. ``flags``:
        ``mm_checked``'s."""
        if c is None:
            config = triton_mm.MM_CONFIG
        else:
            config = triton_mm.add_config(a.shape[0], a.shape[1], b.shape[2], num_sms(a.device))
        if config is None or not self._runs(a) or not (a.is_cuda or interpreting()):
            return None
        # one fallback record per compiled variant: a config may fit shared memory without C only
        name = f"mm_tma{config}{'+c' if c is not None else ''}{'+check' if flags is not None else ''}"
        return launch_or_none(name, lambda: triton_mm.mm_tma(a, b, c, alpha, beta, config=config, out=out, flags=flags))

    def sym_mm(self, a: torch.Tensor, b: torch.Tensor, zero_from: int | None = None) -> torch.Tensor:
        if not self._runs(a):
            return super().sym_mm(a, b)
        return sym_gemm(a, b)

    def sym_addmm(
        self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float, zero_from: int | None = None
    ) -> torch.Tensor:
        if not self._runs(a):
            return super().sym_addmm(a, b, c, alpha, beta)
        return sym_gemm(a, b, c, alpha, beta)

    def fused_update(
        self,
        weight: torch.Tensor,
        update: torch.Tensor,
        rows: torch.Tensor,
        lr: torch.Tensor,
        decay: torch.Tensor,
    ) -> None:
        fused_update(weight, update, rows, lr, decay)

    @staticmethod
    def _runs(a: torch.Tensor) -> bool:
        """fp16/bf16 on a GPU (or anywhere under the interpreter); other dtypes go to torch,
        since a float32 tensor-core product would silently drop to tf32 precision."""
        return a.dtype in _SUPPORTED and (a.is_cuda or interpreting()) and _offsets_fit(a.shape[-2], a.shape[-1])
