"""Persistent TMA GEMM with a fused epilogue: out = alpha * (A @ B) + beta * C, batched.

Newton-Schulz's non-symmetric products are X <- a X + B X (standard NS) and Q X (Gram NS). The
a X term stays out of the product (folding a_t I into B would round B's small diagonal entries
at the magnitude of a_t in fp16, App. B.2.3): it is added to the fp32 accumulator here, from C
read straight into the accumulator's registers, instead of in a second pass.

One program per SM walks the output tiles of every matrix, GROUP tile rows at a time
(column by column inside a band, so programs running together share B panels in L2). A and B
come in by TMA from 2D views that stack the batch along rows (tma.rows_stacked), so every
dimension must be a multiple of its block; ``mm_tma`` returns None otherwise and the caller uses
cuBLAS. Against cuBLAS: docs/benchmarks.md, "Fused GEMM + a X" (on for X <- a X + B X only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dion3_titan.kernels.backend import interpreting
from dion3_titan.kernels.launch import cdiv, launch
from dion3_titan.kernels.rounding import round_to
from dion3_titan.kernels.tma import (
    aligned,
    ensure_scratch_allocator,
    grid_sms,
    mma_step,
    operand_descs,
    rows_stacked,
    stacked_desc,
)


class Config(NamedTuple):
    """A tile config of ``mm_tma``. ``split``: the epilogue reads C and stores the result in two
    halves of BLOCK_N / 2 columns, which halves the output tile's shared memory (room for one
    more pipeline stage). ``ws``: Triton's automatic warp specialization of the tile loop (a
    producer warp feeds the copies, so one tile's epilogue overlaps the next tile's loads)."""

    block_m: int
    block_n: int
    block_k: int
    group: int
    num_warps: int
    num_stages: int
    split: bool = False
    ws: bool = False


# What the Triton backend runs A @ B (MM_CONFIG) and alpha A @ B + beta C (MM_ADD_CONFIG) with;
# None leaves that product to cuBLAS. Chosen from measurements (docs/benchmarks.md, "Fused GEMM
# + a X"): warp-specialized 128 x 256 tiles beat cuBLAS's baddbmm once every SM has
# MM_ADD_MIN_TILES_PER_SM output tiles (measured: 31 per SM wins by 5-7%, 3.9 per SM loses by
# 22%); cuBLAS's bmm stays faster for A @ B on every measured shape.
DEFAULT_CONFIG = Config(128, 256, 64, 8, 8, 3, ws=True)  # of a direct mm_tma call: the fastest measured
MM_CONFIG: Config | None = None
MM_ADD_CONFIG: Config | None = DEFAULT_CONFIG
MM_ADD_MIN_TILES_PER_SM = 8


def add_config(L: int, M: int, N: int, sms: int) -> Config | None:
    """The config the Triton backend computes alpha (L, M, K) @ (L, K, N) + beta C with, or None
    for cuBLAS: MM_ADD_CONFIG where its output tiles give every one of ``sms`` SMs enough."""
    cfg = MM_ADD_CONFIG
    if cfg is None or L * cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n) < MM_ADD_MIN_TILES_PER_SM * sms:
        return None
    return cfg


@triton.jit
def _band_tile(t, tiles_m, tiles_n, GROUP: tl.constexpr):
    """Linear index t -> (row, col) of an output tile: bands of GROUP tile rows, column-major
    inside a band."""
    per_band = GROUP * tiles_n
    band = t // per_band
    first = band * GROUP
    rows = tl.minimum(tiles_m - first, GROUP)
    local = t % per_band
    return first + local % rows, local // rows


@triton.jit
def _mm_tma_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    flag_ptr,
    M,
    N,
    K,
    L,
    s_cb,
    s_cm,
    s_cn,
    alpha,
    beta,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    HAS_C: tl.constexpr,
    CHECK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    WS: tl.constexpr,
    NUM_SMS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """``A_T``/``B_T``: that operand's unit stride is its row dim and its descriptor holds the
    transpose. ``SPLIT``/``WS``: see ``Config``. ``CHECK``: a tile holding a NaN or inf after
    rounding sets its matrix's flag (``mm_tma``'s ``flags``)."""
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, L, BLOCK_M, BLOCK_N, BLOCK_K, A_T, B_T)
    if SPLIT:
        out_desc = stacked_desc(out_ptr, L * M, N, BLOCK_M, BLOCK_N // 2)
    else:
        out_desc = stacked_desc(out_ptr, L * M, N, BLOCK_M, BLOCK_N)
    tiles_m = M // BLOCK_M
    tiles_n = N // BLOCK_N
    per_matrix = tiles_m * tiles_n
    k_tiles = K // BLOCK_K
    for tile in tl.range(tl.program_id(0), L * per_matrix, NUM_SMS, warp_specialize=WS):
        batch = tile // per_matrix
        ti, tj = _band_tile(tile % per_matrix, tiles_m, tiles_n, GROUP)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            acc = mma_step(
                acc, a_desc, b_desc, batch, ti, tj, kk, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, A_T, B_T, INTERPRET
            )
        row, col = ti * BLOCK_M, tj * BLOCK_N
        c_tile = c_ptr + batch.to(tl.int64) * s_cb + row * s_cm + col * s_cn
        out_row = batch * M + row
        flag = flag_ptr + batch
        if SPLIT:  # two halves of BLOCK_N / 2 columns, each read, finished and stored alone
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            _finish(left, c_tile, out_desc, out_row, col, s_cm, s_cn, alpha, beta, flag, HAS_C, CHECK, INTERPRET)
            c_right = c_tile + (BLOCK_N // 2) * s_cn
            right_col = col + BLOCK_N // 2
            _finish(
                right, c_right, out_desc, out_row, right_col, s_cm, s_cn, alpha, beta, flag, HAS_C, CHECK, INTERPRET
            )
        else:
            _finish(acc, c_tile, out_desc, out_row, col, s_cm, s_cn, alpha, beta, flag, HAS_C, CHECK, INTERPRET)


@triton.jit
def _finish(
    acc,
    c_tile,
    out_desc,
    out_row,
    col,
    s_cm,
    s_cn,
    alpha,
    beta,
    flag,
    HAS_C: tl.constexpr,
    CHECK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """alpha * acc + beta * C (torch.baddbmm's order, in float32), rounded and stored by TMA at
    (out_row, col) of the stacked output; ``c_tile`` points at C's element of the block's
    top-left corner. C is read with plain loads straight into the accumulator's registers (any
    strides): a TMA tile of C would need shared memory beside the pipeline's stages and the
    output tile. ``CHECK``: 1 is stored at ``flag`` when a rounded value is NaN or inf (a
    finite float32 value can round to inf)."""
    if HAS_C:
        rows = tl.arange(0, acc.shape[0])
        cols = tl.arange(0, acc.shape[1])
        acc = alpha * acc + beta * tl.load(c_tile + rows[:, None] * s_cm + cols[None, :] * s_cn).to(tl.float32)
    else:
        acc = alpha * acc
    out = round_to(acc, out_desc.dtype, INTERPRET)
    out_desc.store([out_row, col], out)
    if CHECK:  # NaN fails the comparison too
        bad = tl.max(tl.where(tl.abs(out.to(tl.float32)) < float("inf"), 0, 1))
        tl.store(flag, 1, mask=bad > 0)


def mm_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    config: Config | None = None,
    out: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """alpha * (a @ b) + beta * c for (L, M, K) @ (L, K, N), fp16/bf16, into a new contiguous
    (L, M, N) tensor (or ``out``); None when the operands do not fit the kernel (a dimension
    off its block, A or B without a unit stride, mixed dtypes, misaligned storage; C may have any
    strides, each matrix under 2^31 elements). ``flags``: an (L,) int32 tensor in which the
    epilogue sets 1 for each matrix whose result holds a NaN or inf (it never clears one)."""
    cfg = Config(*(config or DEFAULT_CONFIG))
    block_m, block_n, block_k = cfg.block_m, cfg.block_n, cfg.block_k
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"mm expects (L, M, K) @ (L, K, N); got {tuple(a.shape)} @ {tuple(b.shape)}")
    L, M, K = a.shape
    N = b.shape[2]
    has_c = c is not None and beta != 0.0
    sa, sb = rows_stacked(a), rows_stacked(b)
    if (
        a.dtype not in (torch.float16, torch.bfloat16)
        or b.dtype != a.dtype
        or L * M * N * K == 0
        or M % block_m
        or N % block_n
        or K % block_k
        or sa is None
        or sb is None
        or (has_c and (c.shape != (L, M, N) or c.dtype != a.dtype or M * N >= 2**31))
        or (out is not None and not out.is_contiguous())
        or (flags is not None and (flags.shape != (L,) or flags.dtype != torch.int32))
        or not aligned(a, b, c if has_c else None, out)
    ):
        return None
    if out is None:
        out = torch.empty((L, M, N), dtype=a.dtype, device=a.device)
    ensure_scratch_allocator()
    c_arg, c_strides = (c, c.stride()) if has_c else (out, (0, 0, 0))  # C is never read without has_c
    sms = grid_sms(a.device)
    grid = (min(sms, L * (M // block_m) * (N // block_n)),)
    launch(
        _mm_tma_kernel,
        grid,
        sa[0],
        sb[0],
        c_arg,
        out,
        out if flags is None else flags,  # never written without CHECK
        M,
        N,
        K,
        L,
        *c_strides,
        float(alpha),
        float(beta),
        A_T=sa[1],
        B_T=sb[1],
        HAS_C=has_c,
        CHECK=flags is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP=cfg.group,
        SPLIT=cfg.split,
        WS=cfg.ws,
        NUM_SMS=sms,
        INTERPRET=interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
