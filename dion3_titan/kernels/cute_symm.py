"""CuteDSL (nvidia-cutlass-dsl) symmetric GEMM for Hopper (SM90).

D = alpha * A @ B (+ beta * C) for a symmetric result, batched over L, fp16/bf16 in, fp32
accumulate, D in the input dtype. One persistent CTA per SM walks a triangular list of
128 x 128 output tiles (lower triangle and diagonal, all batches, in bands of GROUP tile rows). Each CTA has one producer
warpgroup that streams A and B k-slices into a shared-memory ring with TMA (completion on
mbarriers) and two consumer warpgroups that run wgmma on it (64 rows each). The epilogue
converts the fp32 accumulators to the output dtype and stores the tile twice from registers:
at (i, j) and, through a transposed view of D, at (j, i); a diagonal tile stores its lower
triangle at both places, so the result is exactly symmetric by construction.

Limits (the backend falls back to Triton outside them): CUDA SM90 only, n a multiple of 128,
k a multiple of 8 and each operand with a unit stride in its n or k mode (TMA's 16-byte rule).
Kernels are compiled once per (dtype, operand majors, with C) and cached; shapes are dynamic.
CuteDSL is imported lazily: this module imports without it.

Its speed against cuBLAS and against the Triton backend: docs/kernels.md and docs/benchmarks.md.
"""

import functools  # (no "from __future__ import annotations": CuteDSL evaluates the kernel annotations)
import importlib.util
from typing import Any

import torch

from dion3_titan.kernels.tma import num_sms
from dion3_titan.kernels.triton_ops import TritonOps, tile_order

TILE = 128  # output tile side (square: the triangle of tiles needs square tiles)
TILE_K = 64  # k-slice per pipeline stage
# Tiles in bands of GROUP tile rows, column by column inside a band, so the CTAs running at
# once share A and B panels in L2 (GROUP = 1 is row-major: every CTA of a wave reads its own
# B panel).
GROUP = 8
STAGES = 5  # 5 x 32 KB of A/B slices in shared memory
_THREADS = 384  # warpgroup 0: TMA producer; warpgroups 1, 2: wgmma consumers


def is_available() -> bool:
    """CuteDSL importable and the current GPU is Hopper (SM90); builds nothing."""
    if importlib.util.find_spec("cutlass") is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() == (9, 0)


@functools.cache
def _kernel_class() -> type:
    """Defines the kernel on first use, so that importing this module needs no CuteDSL."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90

    class SymGemmSm90:
        def __init__(self, has_c: bool) -> None:
            self.has_c = has_c
            self.acc_dtype = cutlass.Float32
            self.num_mma_wg = 2
            self.mma_threads = 128 * self.num_mma_wg

        @cute.jit
        def __call__(
            self,
            mA: cute.Tensor,  # (n, k, L)
            mB: cute.Tensor,  # (n, k, L): B^T of the product, i.e. the second operand's rows
            mC: cute.Tensor,  # (n, n, L), read only when has_c
            mD: cute.Tensor,  # (n, n, L) output
            tiles: cute.Tensor,  # (2, T(T+1)/2) int32: row/col of each lower tile, row-major
            num_ctas: cutlass.Int32,
            alpha: cutlass.Float32,
            beta: cutlass.Float32,
            stream: Any,
        ):
            self.ab_dtype = mA.element_type
            a_layout = utils.LayoutEnum.from_tensor(mA)
            b_layout = utils.LayoutEnum.from_tensor(mB)
            self.tiled_mma = sm90.make_trivial_tiled_mma(
                self.ab_dtype,
                self.ab_dtype,
                a_layout.sm90_mma_major_mode(),
                b_layout.sm90_mma_major_mode(),
                self.acc_dtype,
                (2, 1, 1),  # two consumer warpgroups stacked along the tile's rows
                tiler_mn=(64, TILE),
            )
            tile_mnk = (TILE, TILE, TILE_K)
            self.a_smem = sm90.make_smem_layout_a(a_layout, tile_mnk, self.ab_dtype, STAGES)
            self.b_smem = sm90.make_smem_layout_b(b_layout, tile_mnk, self.ab_dtype, STAGES)
            tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                mA,
                cute.slice_(self.a_smem, (None, None, 0)),
                (TILE, TILE_K),
            )
            tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                mB,
                cute.slice_(self.b_smem, (None, None, 0)),
                (TILE, TILE_K),
            )

            @cute.struct
            class Storage:
                barriers: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
                sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem)], 1024]

            self.storage = Storage
            # D transposed: the same memory with the row and column strides swapped
            mDT = cute.make_tensor(
                mD.iterator,
                cute.make_layout(mD.shape, stride=(mD.stride[1], mD.stride[0], mD.stride[2])),
            )
            self.kernel(
                self.tiled_mma, self.a_smem, self.b_smem, tma_a, tA, tma_b, tB, mC, mD, mDT, tiles, alpha, beta
            ).launch(
                grid=(num_ctas, 1, 1),
                block=(_THREADS, 1, 1),
                min_blocks_per_mp=1,
                stream=stream,
            )

        @cute.kernel
        def kernel(
            self,
            tiled_mma: cute.TiledMma,
            a_smem: cute.ComposedLayout,
            b_smem: cute.ComposedLayout,
            tma_a: cute.CopyAtom,
            tA: cute.Tensor,
            tma_b: cute.CopyAtom,
            tB: cute.Tensor,
            mC: cute.Tensor,
            mD: cute.Tensor,
            mDT: cute.Tensor,
            tiles: cute.Tensor,
            alpha: cutlass.Float32,
            beta: cutlass.Float32,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = cute.arch.make_warp_uniform(tidx // 128)
            if warp == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

            smem = utils.SmemAllocator()
            st = smem.allocate(self.storage)
            stage_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0))) + cute.size_in_bytes(
                self.ab_dtype, cute.slice_(b_smem, (None, None, 0))
            )
            # consumers release a stage once per warp (8 warps)
            ring = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.barriers.data_ptr(),
                num_stages=STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4),
                tx_count=stage_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive()
            sA = st.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            sB = st.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)

            # (TILE, TILE_K, tiles_n, tiles_k, L) views of the TMA tensors
            gA = cute.local_tile(tA, (TILE, TILE_K), (None, None, None))
            gB = cute.local_tile(tB, (TILE, TILE_K), (None, None, None))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            k_tiles = cute.size(gA, mode=[3])
            per_batch = cute.size(tiles, mode=[1])
            total = per_batch * cute.size(mD, mode=[2])
            pipeline.pipeline_init_wait()

            if wg == 0:
                # producer: one warp issues the TMA loads of every tile this CTA owns
                cute.arch.setmaxregister_decrease(40)
                if warp == 0:
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
                    t = bidx
                    while t < total:
                        batch = t // per_batch
                        local = t - batch * per_batch
                        ti = tiles[0, local]
                        tj = tiles[1, local]
                        a_k = tAgA[(None, ti, None, batch)]
                        b_k = tBgB[(None, tj, None, batch)]
                        for kt in range(k_tiles):
                            ring.producer_acquire(state)
                            bar = ring.producer_get_barrier(state)
                            cute.copy(tma_a, a_k[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_b, b_k[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                            ring.producer_commit(state)
                            state.advance()
                        t += nblk
                    ring.producer_tail(state)
            else:
                cute.arch.setmaxregister_increase(232)
                thr_mma = tiled_mma.get_slice(tidx - 128)
                tCsA = thr_mma.partition_A(sA)
                tCsB = thr_mma.partition_B(sB)
                tCrA = tiled_mma.make_fragment_A(tCsA)
                tCrB = tiled_mma.make_fragment_B(tCsB)
                k_blocks = cute.size(tCrA, mode=[2])
                gD0 = cute.local_tile(mD, (TILE, TILE), (0, 0, 0))
                acc = cute.make_rmem_tensor(thr_mma.partition_C(gD0).shape, self.acc_dtype)
                out = cute.make_rmem_tensor(acc.shape, mD.element_type)
                tCcD = thr_mma.partition_C(cute.make_identity_tensor((TILE, TILE)))  # (row, col) in a tile
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
                t = bidx
                while t < total:
                    batch = t // per_batch
                    local = t - batch * per_batch
                    ti = tiles[0, local]
                    tj = tiles[1, local]
                    acc.fill(0.0)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.fence()
                    # keep one wgmma batch in flight: release stage s-1 after issuing stage s
                    for kt in range(k_tiles):
                        ring.consumer_wait(read)
                        for kb in cutlass.range_constexpr(k_blocks):
                            cute.gemm(
                                tiled_mma,
                                acc,
                                tCrA[(None, None, kb, read.index)],
                                tCrB[(None, None, kb, read.index)],
                                acc,
                            )
                        cute.nvgpu.warpgroup.commit_group()
                        read.advance()
                        if kt > 0:
                            cute.nvgpu.warpgroup.wait_group(1)
                            ring.consumer_release(release)
                            release.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    ring.consumer_release(release)
                    release.advance()

                    # epilogue: fp32 math, one rounding, two stores
                    tCgD = thr_mma.partition_C(cute.local_tile(mD, (TILE, TILE), (ti, tj, batch)))
                    res = acc.load()
                    if cutlass.const_expr(self.has_c):
                        tCgC = thr_mma.partition_C(cute.local_tile(mC, (TILE, TILE), (ti, tj, batch)))
                        c_in = cute.make_rmem_tensor(acc.shape, mC.element_type)
                        cute.autovec_copy(tCgC, c_in)
                        res = alpha * res + beta * c_in.load().to(self.acc_dtype)
                    else:
                        res = alpha * res
                    out.store(res.to(mD.element_type))
                    tCgDT = thr_mma.partition_C(cute.local_tile(mDT, (TILE, TILE), (ti, tj, batch)))
                    if ti != tj:
                        cute.autovec_copy(out, tCgD)
                        cute.autovec_copy(out, tCgDT)
                    else:
                        # a diagonal tile: its lower triangle in place and mirrored above the
                        # diagonal, so the result is symmetric whatever the MMA's summation order
                        for e in cutlass.range(cute.size(out), unroll_full=True):
                            rc = tCcD[e]
                            if rc[0] >= rc[1]:
                                tCgD[e] = out[e]
                                tCgDT[e] = out[e]
                    t += nblk

    return SymGemmSm90


_DTYPES = {torch.float16: "Float16", torch.bfloat16: "BFloat16"}


def _as_nkl(x: torch.Tensor) -> torch.Tensor:
    """(L, n, k) -> (n, k, L) view, the mode order CuteDSL GEMMs use."""
    return x.permute(1, 2, 0)


def _major(x: torch.Tensor) -> str | None:
    """'k' if the (L, n, k) operand is contiguous along k, 'n' if along n, else None."""
    L, n, k = x.shape
    if x.stride(2) == 1 and (x.stride(1) * x.element_size()) % 16 == 0:
        return "k"
    if x.stride(1) == 1 and (x.stride(2) * x.element_size()) % 16 == 0:
        return "n"
    return None


@functools.cache
def _compiled(dtype_name: str, a_major: str, b_major: str, has_c: bool) -> Any:
    """Compile once per configuration; shapes and strides stay dynamic (symbolic)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = getattr(cutlass, dtype_name)
    n, k, L = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int()

    def operand(major: str) -> Any:
        # (n, k, L): unit stride along k (row-major) or along n (column-major)
        s = cute.sym_int64(divisibility=8)
        sl = cute.sym_int64(divisibility=8)
        stride = (s, 1, sl) if major == "k" else (1, s, sl)
        return make_fake_tensor(dtype, (n, k, L), stride, assumed_align=16)

    square = (n, n, L)
    sq_stride = (cute.sym_int64(divisibility=8), 1, cute.sym_int64(divisibility=8))
    c = make_fake_tensor(dtype, square, sq_stride, assumed_align=16)
    d = make_fake_tensor(
        dtype, square, (cute.sym_int64(divisibility=8), 1, cute.sym_int64(divisibility=8)), assumed_align=16
    )
    tiles = make_fake_tensor(cutlass.Int32, (2, cute.sym_int()), (cute.sym_int(), 1))
    gemm = _kernel_class()(has_c)
    return cute.compile(
        gemm,
        operand(a_major),
        operand(b_major),
        c,
        d,
        tiles,
        cutlass.Int32(1),
        cutlass.Float32(1.0),
        cutlass.Float32(0.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )


@functools.cache
def _tile_table(side: int, group: int, device: torch.device) -> torch.Tensor:
    """(2, T(T+1)/2) int32 rows/cols of the lower-triangle tiles in the order the CTAs take
    them: the Triton kernels' banded order (``triton_ops.tile_order``, one rule for both)."""
    return tile_order(side, group, device).T.contiguous()


def sym_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """alpha * a @ b (+ beta * c) for a symmetric result; None when the shape or strides are
    outside the kernel's limits (the caller falls back). ``out``: a contiguous (L, n, n) result
    buffer (tests pass a NaN-filled one)."""
    L, n, k = a.shape
    bt = b.mT  # (L, n, k): the rows of b^T
    a_major, b_major = _major(a), _major(bt)
    if (
        a.dtype not in _DTYPES
        or b.dtype != a.dtype
        or n % TILE != 0
        or k % 8 != 0
        or a_major is None
        or b_major is None
        or L == 0
        or k == 0
    ):
        return None
    has_c = c is not None and beta != 0.0
    if has_c and (c.stride(2) != 1 or c.dtype != a.dtype):
        c = c.contiguous().to(a.dtype)
    if out is None:
        out = torch.empty((L, n, n), dtype=a.dtype, device=a.device)
    fn = _compiled(_DTYPES[a.dtype], a_major, b_major, has_c)
    side = n // TILE
    table = _tile_table(side, GROUP, a.device)
    ctas = min(num_sms(a.device), L * table.shape[1])
    fn(
        _as_nkl(a),
        _as_nkl(bt),
        _as_nkl(c if has_c else out),
        _as_nkl(out),
        table,
        ctas,
        float(alpha),
        float(beta),
    )
    return out


class CuteOps(TritonOps):
    """Symmetric products through the CuteDSL SM90 kernel (Triton outside its limits);
    general products and the fused update as in the Triton backend."""

    name = "cute"

    def __init__(self) -> None:
        if not is_available():
            raise RuntimeError(
                "backend='cute' needs nvidia-cutlass-dsl importable and a Hopper (SM90) CUDA GPU; "
                "use backend='triton' or 'auto'"
            )

    def sym_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = sym_gemm(a, b)
        return out if out is not None else super().sym_mm(a, b)  # shapes off the tile grid

    def sym_addmm(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        out = sym_gemm(a, b, c, alpha, beta)
        return out if out is not None else super().sym_addmm(a, b, c, alpha, beta)
