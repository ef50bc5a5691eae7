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

import torch
import triton
import triton.language as tl

from dion3_titan.kernels import triton_mm
from dion3_titan.kernels.backend import interpreting
from dion3_titan.kernels.launch import cdiv, launch, next_power_of_2
from dion3_titan.kernels.rounding import round_to
from dion3_titan.kernels.row_engine import row_slots, update_rows
from dion3_titan.kernels.tma import aligned, launch_or_none, mma_step, num_sms, operand_descriptors, rows_stacked
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
def _sym_gemm_tma_kernel(
    a_desc,
    b_desc,
    c_desc,
    out_desc,
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
    NUM_SMS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Persistent form of ``_sym_gemm_kernel`` for n % BLOCK == 0 and k % BLOCK_K == 0: one
    program per SM walks the lower tiles of every matrix; operands come in by TMA from 2D views
    that stack the batch along rows, so a tile never straddles two matrices. ``A_T``/``B_T``:
    the operand's unit stride is its row dim, and the descriptor holds its transpose. ``WS``:
    Triton's automatic warp specialization of the tile loop (see triton_mm.Config)."""
    side = n // BLOCK
    per_matrix = side * (side + 1) // 2
    k_tiles = k // BLOCK_K
    for tile in tl.range(tl.program_id(0), L * per_matrix, NUM_SMS, warp_specialize=WS):
        batch = tile // per_matrix
        ti, tj = _lower_tile(tile % per_matrix, side, GROUP)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for kk in range(k_tiles):
            acc = mma_step(acc, a_desc, b_desc, batch, ti, tj, kk, n, n, k, BLOCK, BLOCK, BLOCK_K, A_T, B_T, INTERPRET)
        if HAS_C:
            c = c_desc.load([batch * n + ti * BLOCK, tj * BLOCK]).to(tl.float32)
            acc = alpha * acc + beta * c
        else:
            acc = alpha * acc
        res = round_to(acc, out_desc.dtype, INTERPRET)
        if ti == tj:  # see _sym_gemm_kernel
            r = tl.arange(0, BLOCK)
            res = tl.where(r[:, None] >= r[None, :], res, tl.trans(res))
        out_desc.store([batch * n + ti * BLOCK, tj * BLOCK], res)
        if ti != tj:
            out_desc.store([batch * n + tj * BLOCK, ti * BLOCK], tl.trans(res))


@triton.jit
def _tile_order_kernel(out_ptr, count, side, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    i, j = _lower_tile(t, side, GROUP)
    tl.store(out_ptr + 2 * t, i, mask=t < count)
    tl.store(out_ptr + 2 * t + 1, j, mask=t < count)


def tile_order(side: int, group: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T(T+1)/2, 2) int32: the (row, col) tile each program of the symmetric GEMM computes, in
    launch order, for ``side`` = T tiles per side (for tests and for reading the schedule)."""
    count = side * (side + 1) // 2
    out = torch.full((count, 2), -1, dtype=torch.int32, device=device)
    _tile_order_kernel[(1,)](out, count, side, GROUP=group, BLOCK=next_power_of_2(count))
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
        done = launch_or_none("sym_gemm_tma", lambda: sym_gemm_tma(a, b, c, alpha, beta, out=out))
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


# Persistent TMA form: SYM_CONFIG's fields, then an optional warp-specialization flag (the
# fastest config tried); None turns it off.
TMA_CONFIG: tuple | None = (128, 64, 8, 8, 4)
# The persistent kernel pays off once every SM has enough work to walk, counted in k-steps of
# its tiles (tiles x k / BLOCK_K per SM): at the same 576 tiles it wins at k = 4096 and loses
# at k = 1024. Below the threshold the per-tile kernel is faster. Measurements of both
# (docs/benchmarks.md, "Symmetric GEMM dispatch"): per-tile wins at 70 and 132 k-steps per SM,
# persistent at 140 (by 10%) and from 279 on; 200 keeps a margin from the loss at 132.
TMA_MIN_KSTEPS_PER_SM = 200


def tma_pays(L: int, n: int, k: int, sms: int) -> bool:
    """Whether ``sym_gemm`` takes the persistent kernel for L products (n x k) @ (k x n)."""
    block, block_k = TMA_CONFIG[0], TMA_CONFIG[1]
    side = cdiv(n, block)
    return L * side * (side + 1) // 2 * cdiv(k, block_k) >= TMA_MIN_KSTEPS_PER_SM * sms


def sym_gemm_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    config: tuple[int, int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``sym_gemm`` through the persistent TMA kernel, or None when the operands do not fit it
    (n % BLOCK, k % BLOCK_K, an operand without a unit-stride dim, a non-contiguous C or out,
    misaligned storage): the caller then uses the general kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    L, n, k = _check_sym_operands(a, b)
    block, block_k, group, num_warps, num_stages, *flags = config or TMA_CONFIG
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
    a_desc, b_desc, a_t, b_t = operand_descriptors(sa, sb, block, block, block_k)
    out_desc = TensorDescriptor.from_tensor(out.view(L * n, n), [block, block])
    c_desc = TensorDescriptor.from_tensor(c.view(L * n, n), [block, block]) if has_c else out_desc
    sms = num_sms(a.device)
    side = n // block
    grid = (min(sms, L * side * (side + 1) // 2),)
    launch(
        _sym_gemm_tma_kernel,
        grid,
        a_desc,
        b_desc,
        c_desc,
        out_desc,
        n,
        k,
        L,
        float(alpha),
        float(beta),
        A_T=a_t,
        B_T=b_t,
        HAS_C=has_c,
        BLOCK=block,
        BLOCK_K=block_k,
        GROUP=group,
        WS=bool(flags and flags[0]),
        NUM_SMS=sms,
        INTERPRET=interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
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
        block = TMA_CONFIG[0] if TMA_CONFIG is not None else 1
        return n if n <= block else cdiv(n, block) * block

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = self._mm(a, b, None, 1.0, 0.0, triton_mm.MM_CONFIG)
        return out if out is not None else super().mm(a, b)

    def mm_add(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        config = triton_mm.add_config(a.shape[0], a.shape[1], b.shape[2], num_sms(a.device))
        out = self._mm(a, b, c, alpha, beta, config)
        return out if out is not None else super().mm_add(a, b, c, alpha, beta)

    def _mm(self, a, b, c, alpha, beta, config) -> torch.Tensor | None:
        """The persistent TMA GEMM where it is switched on (config) and the operands fit it;
        None sends the product to cuBLAS."""
        if config is None or not self._runs(a) or not (a.is_cuda or interpreting()):
            return None
        # one fallback record per compiled variant: a config may fit shared memory without C only
        name = f"mm_tma{config}{'+c' if c is not None else ''}"
        return launch_or_none(name, lambda: triton_mm.mm_tma(a, b, c, alpha, beta, config=config))

    def sym_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self._runs(a):
            return super().sym_mm(a, b)
        return sym_gemm(a, b)

    def sym_addmm(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
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
