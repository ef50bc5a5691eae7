"""The CuteDSL (nvidia-cutlass-dsl) kernel behind ``cute_symm``: a symmetric GEMM for Hopper (SM90).

D = alpha * A @ B (+ beta * C) for a symmetric result, batched over L, fp16/bf16 in, fp32
accumulate, D in the input dtype. One persistent CTA per SM walks a triangular list of
128 x 128 output tiles (lower triangle and diagonal, all batches, in the order of the table the
host passes: bands of ``cute_symm.GROUP`` tile rows). Each CTA has one producer warpgroup that
streams A and B k-slices into a shared-memory ring with TMA (completion on mbarriers) and two
consumer warpgroups that run wgmma on it (64 rows each). The epilogue
converts the fp32 accumulators to the output dtype and writes the tile twice into shared
memory, once row-major and once column-major (``stmatrix`` and its transposing form); TMA
stores them at (i, j) of D and at (i, j) of D's transposed view, i.e. at (j, i) of D. The
stores run while the consumers start the next tile's mainloop; only the next epilogue waits
for them to have read shared memory. A diagonal tile is stored once; where the product's two
operands differ (Q Z of Gram NS), it first takes the transpose of its lower triangle as its
upper one in shared memory, so the result is exactly symmetric by construction (16-byte copies
from the column-major tile, whose layout is the row-major one's with the modes swapped). Where
they are the same matrix (X X^T, A A with A symmetric), D[r, c] and D[c, r] are the same
products summed in the same order, symmetric as computed, and that mirror is left out.
C (for alpha A B + beta C) comes by TMA into the row-major shared tile: the producer loads it
after the tile's last A/B slice, once the store warp has seen the previous tile's stores read
that tile.

The pair form (sides from ``cute_symm.PAIR_MIN_N`` on, multiples of 256): a cluster of two CTAs computes one
256 x 256 tile of the lower triangle, each CTA 128 x 256 (each consumer warpgroup a 64 x 256
wgmma). The B panel (256 rows) is shared: each CTA loads half of it by TMA and multicasts it to
both, so a CTA loads 32 KB per k-slice for twice the products of a 128 x 128 tile (the L2 traffic
per FLOP halves, which is what the 128 x 128 form is bound by at large sides). Consumers release
a stage to both CTAs' producers. The epilogue takes the CTA tile as two 128 x 128 blocks through
the same two shared tiles, one after the other; on the diagonal the block above it is not
stored, and (``cute_symm.HALF_DIAGONAL``) not computed: the first CTA of a diagonal tile runs 64 x 128
wgmmas on the B panel's first 128 rows into its accumulator's first block.
A caller that names the zero rows of A (``zero_from``, the padding of a Gram side) gets the kernel
compiled with ``skip_rows``: a consumer warpgroup whose 64 rows all lie there waits for and
releases its slots without multiplying (``cute_symm.SKIP_ZERO_ROWS``).
With C, the second block of C comes into the column-major tile through C's transposed view (C is
symmetric), and both blocks of C are read before either is overwritten.

The general mode (``gemm``: alpha A B + beta C with no symmetry, X <- a X + B X of standard
Newton-Schulz): every tile of the (n, m) result in the same banded order, both epilogue tiles
row-major, each 128 x 128 block stored as computed (a pair's second block, and its C, through
the second tile). Its checked variant (``gemm``'s ``flags``, Newton-Schulz's last product) also
flags each matrix whose rounded result holds a NaN or inf: every consumer thread takes the
NaN-propagating max of |x| over its values of a block, and one that is not below inf stores
the flag (a plain store: every writer writes 1).

The kernel class is defined on first use (``kernel_class``), so that importing this module needs
no CuteDSL; ``cute_symm`` compiles it per configuration, chooses the form and launches it.
"""

import functools  # (no "from __future__ import annotations": CuteDSL evaluates the kernel annotations)
from typing import Any

TILE = 128  # output tile side (square: the triangle of tiles needs square tiles)
TILE_K = 64  # k-slice per pipeline stage
WG_ROWS = TILE // 2  # a consumer warpgroup's rows of the tile (what skip_rows leaves out at once)
_THREADS = 384  # warpgroup 0: TMA producer; warpgroups 1, 2: wgmma consumers
_MMA_THREADS = 256
_EPI_BARRIER = 1  # named barrier of the two consumer warpgroups (0 is the CTA's)
_STORE_WARP = 4  # first consumer warp: issues the epilogue's TMA stores
_C_FREE_KT = 4  # mainloop steps before the epilogue tiles are freed for C (the stores take < 1)
EPI_TILE = (TILE, 32)  # the epilogue's register-to-shared strips (CUTLASS's SM90 cooperative choice)
_CHUNK = 8  # the diagonal mirror's unit: 8 columns of a row, 16 bytes (one vector access)
_ROW_CHUNKS = TILE // _CHUNK
_INF = float("inf")


@functools.cache
def kernel_class() -> type:
    """Defines the kernel on first use, so that importing this module needs no CuteDSL."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90

    def _tma_tiles(atom: Any, tensor: Any, smem: Any, tile: tuple, cta: Any = 0, ctas: int = 1) -> tuple[Any, Any]:
        """A TMA tensor cut into ``tile``s, partitioned for ``atom`` against the shared-memory
        tile ``smem`` (staged or not): (box, stage) and (box, tile coordinates..., L). With
        ``ctas`` > 1 the box is shared by that many CTAs of a cluster (a multicast load), each
        loading the part ``cta`` of it."""
        tiles = cute.local_tile(tensor, tile, (None, None, None))
        return cute.nvgpu.cpasync.tma_partition(
            atom, cta, cute.make_layout(ctas), cute.group_modes(smem, 0, 2), cute.group_modes(tiles, 0, 2)
        )

    def _modes(t: Any, order: tuple[int, int, int]) -> Any:
        """The tensor t with its modes in ``order``: a view of the same memory."""
        shape = tuple(t.shape[i] for i in order)
        return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=tuple(t.stride[i] for i in order)))

    def _tile_at(tiles: Any, t: Any, per_batch: Any, cm: int, rank: Any) -> tuple[Any, Any, Any, Any]:
        """The t-th tile of the CTAs' walk over every batch's table of cluster tiles: its batch,
        its cluster tile (ti, tj) and this CTA's 128-row block of D (its rank in the cluster)."""
        batch = t // per_batch
        local = t - batch * per_batch
        ti = tiles[0, local]
        return batch, ti, tiles[1, local], ti * cm + rank

    def _load_slice(ring: Any, state: Any, a: tuple, b: tuple, kt: Any, cm: int) -> None:
        """The producer's k-slice kt of a tile into the ring's stage ``state``: ``a`` and ``b``
        are (TMA atom, the tile's slices, the staged shared-memory tile); a pair's CTA loads its
        half of the B panel, multicast to both CTAs."""
        (tma_a, a_k, sA), (tma_b, b_k, sB) = a, b
        ring.producer_acquire(state)
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_a, a_k[(None, kt)], sA[(None, state.index)], tma_bar_ptr=bar)
        if cutlass.const_expr(cm > 1):
            mask = cutlass.Int16((1 << cm) - 1)
            cute.copy(tma_b, b_k[(None, kt)], sB[(None, state.index)], tma_bar_ptr=bar, mcast_mask=mask)
        else:
            cute.copy(tma_b, b_k[(None, kt)], sB[(None, state.index)], tma_bar_ptr=bar)
        ring.producer_commit(state)

    @cute.jit
    def _store_block(out: Any, at: tuple, copies: tuple, tiles: tuple, mirror_views: tuple, stores: tuple) -> None:
        """A symmetric product's 128 x 128 block of D, rounded in the registers ``out`` (retiled
        for the epilogue's shared-memory copies), stored at ``at`` = (i, j, batch) if j <= i: the
        store warp waits for the previous stores to have read the two epilogue tiles, the
        consumers write the block into both (row- and column-major), a diagonal block takes its
        upper triangle from its lower (``mirror_views``: empty when the product needs no mirror),
        and the store warp sends them to (i, j) of D and of D's transposed view."""
        i, j, batch = at
        warp, mma_tidx, strip_regs, r2s_d, r2s_dt = copies
        sD_strips, sDT_strips = tiles
        tma_d, tDsD, tDgD, tma_dt, tTsT, tTgT = stores
        strips = cute.size(sD_strips, mode=[3])
        per_strip = cute.size(strip_regs)
        if j <= i:  # a pair's tile on the diagonal has one block above it
            # the previous block's (or tile's) stores must have read the tiles
            if warp == _STORE_WARP:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            # ... and every thread be done with C's blocks
            cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=_MMA_THREADS)
            for strip in cutlass.range_constexpr(strips):
                for v in cutlass.range_constexpr(per_strip):
                    strip_regs[v] = out[strip * per_strip + v]
                cute.copy(r2s_d, strip_regs, r2s_d.partition_D(sD_strips[(None, None, 0, strip)]))
                cute.copy(r2s_dt, strip_regs, r2s_dt.partition_D(sDT_strips[(None, None, 0, strip)]))
            if cutlass.const_expr(len(mirror_views) > 0):
                sD_chunks, sDT_as_D, upper, lower = mirror_views
                if i == j:
                    # a diagonal block: the upper triangle becomes the transpose of the lower,
                    # whatever the MMA's summation order. sDT holds the block too, in a layout
                    # that is sD's with its modes swapped: sDT[c, r] lies at sD[r, c]'s offset.
                    # So the mirror copies sDT's memory into sD's at equal offsets, 16 bytes (8
                    # columns of a row) at a time; a chunk the diagonal crosses keeps its lower
                    # part (merged in registers). Chunks are dealt round-robin, so every warp
                    # gets rows from the whole block.
                    cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=_MMA_THREADS)
                    for e in cutlass.range_constexpr(TILE * _ROW_CHUNKS // _MMA_THREADS):
                        q = e * _MMA_THREADS + mma_tidx
                        r = q // _ROW_CHUNKS
                        chunk = q - r * _ROW_CHUNKS
                        c0 = chunk * _CHUNK
                        if c0 + _CHUNK - 1 > r:  # some of its columns lie above the diagonal
                            cute.autovec_copy(sDT_as_D[(None, (r, chunk))], upper)
                            if c0 <= r:
                                cute.autovec_copy(sD_chunks[(None, (r, chunk))], lower)
                                for v in cutlass.range_constexpr(_CHUNK):
                                    if c0 + v <= r:
                                        upper[v] = lower[v]
                            cute.autovec_copy(upper, sD_chunks[(None, (r, chunk))])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=_MMA_THREADS)
            if warp == _STORE_WARP:
                cute.copy(tma_d, tDsD, tDgD[(None, i, j, batch)])
                if i != j:
                    cute.copy(tma_dt, tTsT, tTgT[(None, i, j, batch)])
                cute.arch.cp_async_bulk_commit_group()

    class SymGemmSm90:
        def __init__(
            self,
            has_c: bool,
            stages: int,
            pair: bool = False,
            mirror: bool = True,
            general: bool = False,
            check: bool = False,
            half_diagonal: bool = False,
            skip_rows: bool = False,
        ) -> None:
            self.has_c = has_c
            # check (general mode): a block holding a NaN or inf once rounded sets its matrix's
            # flag, so the caller need not read the result again to know (``gemm``'s ``flags``)
            self.check = check and general
            # general: every tile of a (n, m) product, no symmetry (X <- a X + B X); both epilogue
            # tiles row-major, a pair's second block through the second one
            self.general = general
            self.stages = stages
            # mirror: a diagonal block's upper triangle is written as the transpose of its lower
            # (module docstring: where the product needs it)
            self.mirror = mirror and not general
            # a pair: two CTAs of a cluster share the B panel of one 256 x 256 tile (one TMA
            # load multicast to both); alone: one CTA per 128 x 128 tile
            self.cm = 2 if pair else 1
            self.tile_n = TILE * self.cm  # the CTA tile's columns and the cluster tile's side
            # half_diagonal: on a pair's diagonal tile the first CTA runs 64 x 128 products on
            # the first half of the B panel only, its block above the diagonal not computed
            self.half_diagonal = half_diagonal and self.cm > 1 and not general
            # skip_rows: a consumer warpgroup whose 64 rows of A all lie at or past ``zero_from``
            # (the zero padding of a Gram side) waits for and releases its slots without
            # multiplying; its accumulator keeps the zeros it starts from
            self.skip_rows = skip_rows and not general
            self.acc_dtype = cutlass.Float32
            self.num_mma_wg = 2
            self.mma_threads = 128 * self.num_mma_wg

        def _mma(self, a_layout: Any, b_layout: Any, tile_n: int) -> Any:
            return sm90.make_trivial_tiled_mma(
                self.ab_dtype,
                self.ab_dtype,
                a_layout.sm90_mma_major_mode(),
                b_layout.sm90_mma_major_mode(),
                self.acc_dtype,
                (2, 1, 1),  # two consumer warpgroups stacked along the tile's rows
                tiler_mn=(64, tile_n),
            )

        @cute.jit
        def __call__(
            self,
            mA: cute.Tensor,  # (L, n, k)
            mB: cute.Tensor,  # (L, k, m): the product's second operand
            mC: cute.Tensor,  # (L, n, m), read only when has_c
            mD: cute.Tensor,  # (L, n, m) output, row-major
            tiles: cute.Tensor,  # (2, T(T+1)/2) int32: row/col of each lower cluster tile
            flags: cute.Tensor,  # (L,) int32, written only with check
            num_ctas: cutlass.Int32,
            zero_from: cutlass.Int32,  # A's rows from here on are zero (read only with skip_rows)
            alpha: cutlass.Float32,
            beta: cutlass.Float32,
            stream: Any,
        ):
            # taken in torch's mode order, so the host passes its tensors as they are (a view
            # made per launch costs host time); CuteDSL's GEMMs work in (rows, k, L): A as
            # (n, k, L), B as its transpose's rows (m, k, L), C and D as (n, m, L)
            mA, mB = _modes(mA, (1, 2, 0)), _modes(mB, (2, 1, 0))
            mC, mD = _modes(mC, (1, 2, 0)), _modes(mD, (1, 2, 0))
            self.ab_dtype = mA.element_type
            self.d_dtype = mD.element_type
            a_layout = utils.LayoutEnum.from_tensor(mA)
            b_layout = utils.LayoutEnum.from_tensor(mB)
            self.tiled_mma = self._mma(a_layout, b_layout, self.tile_n)
            # the epilogue works on 128 x 128 blocks of the CTA tile, partitioned as one of them
            self.epi_mma = self._mma(a_layout, b_layout, TILE)
            tile_mnk = (TILE, self.tile_n, TILE_K)
            self.a_smem = sm90.make_smem_layout_a(a_layout, tile_mnk, self.ab_dtype, self.stages)
            self.b_smem = sm90.make_smem_layout_b(b_layout, tile_mnk, self.ab_dtype, self.stages)
            tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                mA,
                cute.slice_(self.a_smem, (None, None, 0)),
                (TILE, TILE_K),
            )
            b_op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            if cutlass.const_expr(self.cm > 1):
                b_op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
                b_op,
                mB,
                cute.slice_(self.b_smem, (None, None, 0)),
                (self.tile_n, TILE_K),
                num_multicast=self.cm,
            )
            # The epilogue's two shared-memory tiles: row-major for D at (i, j), column-major for
            # D's transposed view at (i, j) (the same memory with the row and column strides
            # swapped), whose TMA box is contiguous along the view's rows.
            row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
            second = row if self.general else col
            self.d_smem = cute.slice_(sm90.make_smem_layout_epi(self.d_dtype, row, (TILE, TILE), 1), (None, None, 0))
            self.dt_smem = cute.slice_(
                sm90.make_smem_layout_epi(self.d_dtype, second, (TILE, TILE), 1), (None, None, 0)
            )
            # D's transposed view (the product is square when symmetric); general: the second
            # tile stores a pair's second block of D itself
            mDT = mD if self.general else _modes(mD, (1, 0, 2))
            tma_d, tD = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mD, self.d_smem, (TILE, TILE)
            )
            tma_dt, tDT = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mDT, self.dt_smem, (TILE, TILE)
            )
            tma_c, tC = tma_d, tD  # unused without C
            tma_ct, tCT = tma_dt, tDT  # unused without C or alone
            if cutlass.const_expr(self.has_c):
                # C's first block comes into the row-major epilogue tile, which it shares with D's
                tma_c, tC = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mC, self.d_smem, (TILE, TILE)
                )
                if cutlass.const_expr(self.cm > 1):
                    # a pair's second block of C comes into the column-major tile through C's
                    # transposed view: block (i, j) of C^T is block (i, j) of C, C being symmetric
                    # (general: into the second row-major tile from C itself)
                    mCT = mC if self.general else _modes(mC, (1, 0, 2))
                    tma_ct, tCT = cute.nvgpu.cpasync.make_tiled_tma_atom(
                        cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mCT, self.dt_smem, (TILE, TILE)
                    )

            @cute.struct
            class Storage:
                barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                c_barriers: cute.struct.MemRange[cutlass.Int64, 2]
                sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem)], 1024]
                sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem)], 1024]
                sDT: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.dt_smem)], 1024]

            self.storage = Storage
            self.kernel(
                self.tiled_mma,
                self.epi_mma,
                self.a_smem,
                self.b_smem,
                self.d_smem,
                self.dt_smem,
                tma_a,
                tA,
                tma_b,
                tB,
                tma_d,
                tD,
                tma_dt,
                tDT,
                tma_c,
                tC,
                tma_ct,
                tCT,
                tiles,
                flags,
                zero_from,
                alpha,
                beta,
            ).launch(
                grid=(num_ctas, 1, 1),
                block=(_THREADS, 1, 1),
                cluster=(self.cm, 1, 1),
                min_blocks_per_mp=1,
                stream=stream,
            )

        @cute.kernel
        def kernel(
            self,
            tiled_mma: cute.TiledMma,
            epi_mma: cute.TiledMma,
            a_smem: cute.ComposedLayout,
            b_smem: cute.ComposedLayout,
            d_smem: cute.ComposedLayout,
            dt_smem: cute.ComposedLayout,
            tma_a: cute.CopyAtom,
            tA: cute.Tensor,
            tma_b: cute.CopyAtom,
            tB: cute.Tensor,
            tma_d: cute.CopyAtom,
            tD: cute.Tensor,
            tma_dt: cute.CopyAtom,
            tDT: cute.Tensor,
            tma_c: cute.CopyAtom,
            tC: cute.Tensor,
            tma_ct: cute.CopyAtom,
            tCT: cute.Tensor,
            tiles: cute.Tensor,
            flags: cute.Tensor,
            zero_from: cutlass.Int32,
            alpha: cutlass.Float32,
            beta: cutlass.Float32,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            # the work is dealt per cluster (a CTA alone is a cluster of one)
            first, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            rank = cutlass.Int32(0)  # this CTA's 128-row half of a pair's tile
            if cutlass.const_expr(self.cm > 1):
                first, _, _ = cute.arch.cluster_idx()
                nblk, _, _ = cute.arch.cluster_dim()
                rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = cute.arch.make_warp_uniform(tidx // 128)
            if warp == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            if warp == _STORE_WARP:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_d)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_dt)
            if cutlass.const_expr(self.has_c):
                if warp == 0:
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
                    if cutlass.const_expr(self.cm > 1):
                        cute.nvgpu.cpasync.prefetch_descriptor(tma_ct)

            smem = utils.SmemAllocator()
            st = smem.allocate(self.storage)
            stage_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0))) + cute.size_in_bytes(
                self.ab_dtype, cute.slice_(b_smem, (None, None, 0))
            )
            # consumers release a stage once per warp (8 warps), to every CTA whose loads
            # fill it (a pair's B half comes from the other CTA)
            ring = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.barriers.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4 * self.cm),
                tx_count=stage_bytes,
                cta_layout_vmnk=cute.make_layout((1, self.cm, 1, 1)),
                defer_sync=True,
            )
            # C's blocks of a tile, one tile at a time: loaded by the producer once the epilogue
            # tiles are free (the previous tile's stores have read them: the store warp releases
            # them in the mainloop)
            c_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.c_barriers.data_ptr(),
                num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=cute.size_in_bytes(self.d_dtype, d_smem) * self.cm,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cm, 1), is_relaxed=True)
            sA = st.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            sB = st.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            sD = st.sD.get_tensor(d_smem.outer, swizzle=d_smem.inner)
            sDT = st.sDT.get_tensor(dt_smem.outer, swizzle=dt_smem.inner)
            sDT_rows = st.sDT.get_tensor(d_smem.outer, swizzle=d_smem.inner)  # its memory in sD's layout

            # each TMA tensor as (TMA box, tile coordinates..., L) beside its shared-memory tile;
            # a pair's CTAs each load one half of the B box, multicast to both
            tAsA, tAgA = _tma_tiles(tma_a, tA, sA, (TILE, TILE_K))
            tBsB, tBgB = _tma_tiles(tma_b, tB, sB, (self.tile_n, TILE_K), rank, self.cm)
            tDsD, tDgD = _tma_tiles(tma_d, tD, sD, (TILE, TILE))
            tTsT, tTgT = _tma_tiles(tma_dt, tDT, sDT, (TILE, TILE))
            tCsC, tCgC = _tma_tiles(tma_c, tC, sD, (TILE, TILE))
            tUsU, tUgU = _tma_tiles(tma_ct, tCT, sDT, (TILE, TILE))
            k_tiles = cute.size(tAgA, mode=[2])
            per_batch = cute.size(tiles, mode=[1])
            total = per_batch * cute.size(tDgD, mode=[3])
            # the mainloop steps after which the store warp frees the epilogue tiles for C
            c_split = cutlass.min(_C_FREE_KT, k_tiles)
            pipeline.pipeline_init_wait(cluster_shape_mn=(self.cm, 1))

            if wg == 0:
                # producer: one warp issues the TMA loads of every tile this CTA owns
                cute.arch.setmaxregister_decrease(40)
                if warp == 0:
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    c_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                    t = first
                    while t < total:
                        batch, _, tj, i = _tile_at(tiles, t, per_batch, self.cm, rank)
                        a_k = tAgA[(None, i, None, batch)]
                        b_k = tBgB[(None, tj, None, batch)]
                        # the tile's A/B slices, then C's blocks; the state advances in the loop
                        # body (see the consumers' k-loop)
                        a, b = (tma_a, a_k, tAsA), (tma_b, b_k, tBsB)
                        for kt in range(k_tiles):
                            _load_slice(ring, state, a, b, kt, self.cm)
                            state.advance()
                        if cutlass.const_expr(self.has_c):
                            c_pipe.producer_acquire(c_state)
                            c_bar = c_pipe.producer_get_barrier(c_state)
                            cute.copy(tma_c, tCgC[(None, i, tj * self.cm, batch)], tCsC, tma_bar_ptr=c_bar)
                            if cutlass.const_expr(self.cm > 1):
                                cute.copy(tma_ct, tUgU[(None, i, tj * self.cm + 1, batch)], tUsU, tma_bar_ptr=c_bar)
                            c_pipe.producer_commit(c_state)
                            c_state.advance()
                        t += nblk
                    ring.producer_tail(state)
            else:
                cute.arch.setmaxregister_increase(232)
                mma_tidx = tidx - 128
                thr_mma = tiled_mma.get_slice(mma_tidx)
                thr_epi = epi_mma.get_slice(mma_tidx)
                tCsA = thr_mma.partition_A(sA)
                tCsB = thr_mma.partition_B(sB)
                tCrA = tiled_mma.make_fragment_A(tCsA)
                tCrB = tiled_mma.make_fragment_B(tCsB)
                k_blocks = cute.size(tCrA, mode=[2])
                acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((TILE, self.tile_n)), self.acc_dtype)
                # the products a tile runs: (MMA, accumulator, A and B fragments); with
                # half_diagonal, a second set for the first CTA of a diagonal pair tile: the
                # epilogue's 128 x 128 MMA on the B panel's first 128 rows, into the accumulator's
                # first block (its registers come first: the epilogue reads it from there)
                products = [(tiled_mma, acc, tCrA, tCrB)]
                if cutlass.const_expr(self.half_diagonal):
                    sB_half = cute.flat_divide(sB, (TILE, TILE_K))[(None, None, 0, 0, None)]
                    acc_half = cute.make_tensor(acc.iterator, cute.make_layout(epi_mma.partition_shape_C((TILE, TILE))))
                    half_a = epi_mma.make_fragment_A(thr_epi.partition_A(sA))
                    half_b = epi_mma.make_fragment_B(thr_epi.partition_B(sB_half))
                    products.append((epi_mma, acc_half, half_a, half_b))
                # C's blocks in the accumulator's thread layout: the second (a pair's) in sDT
                tEsC = [thr_epi.partition_C(sD), thr_epi.partition_C(sDT)][: self.cm]
                block = cute.make_rmem_tensor(tEsC[0].shape, self.acc_dtype)
                per_block = cute.size(block)
                outs = [cute.make_rmem_tensor(tEsC[0].shape, self.d_dtype) for _ in range(self.cm)]
                c_in = cute.make_rmem_tensor(tEsC[0].shape, self.d_dtype)
                # registers -> the two shared-memory tiles, in column strips of EPI_TILE: the
                # accumulator's registers come in strip order (as CUTLASS's SM90 epilogue takes them)
                row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
                r2s_d = cute.make_tiled_copy_S(
                    sm90.get_smem_store_op(row, self.d_dtype, self.acc_dtype),
                    cute.make_tiled_copy_C_atom(
                        cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.d_dtype), epi_mma
                    ),
                ).get_slice(mma_tidx)
                r2s_dt = cute.make_tiled_copy_S(
                    sm90.get_smem_store_op(col, self.d_dtype, self.acc_dtype),
                    cute.make_tiled_copy_C_atom(
                        cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4), self.d_dtype), epi_mma
                    ),
                ).get_slice(mma_tidx)
                sD_strips = cute.flat_divide(sD, EPI_TILE)  # (EPI_M, EPI_N, 1, strips)
                # the diagonal mirror's view: both tiles in 8-column chunks, sDT read through
                # sD's layout (its transpose's offsets)
                sD_chunks = cute.zipped_divide(sD, (1, _CHUNK))  # ((1, 8), (rows, chunks))
                sDT_as_D = cute.zipped_divide(sDT_rows, (1, _CHUNK))
                upper = cute.make_rmem_tensor(cute.make_layout((1, _CHUNK)), self.d_dtype)
                lower = cute.make_rmem_tensor(cute.make_layout((1, _CHUNK)), self.d_dtype)
                sDT_strips = cute.flat_divide(sDT, EPI_TILE)
                strips = cute.size(sD_strips, mode=[3])
                rs_outs = [r2s_d.retile(out) for out in outs]
                strip_shape = r2s_d.partition_D(sD_strips[(None, None, 0, 0)]).shape
                strip_regs = cute.make_rmem_tensor(cute.make_layout(strip_shape), self.d_dtype)
                per_strip = cute.size(strip_regs)
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                c_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
                c_free = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
                # what the symmetric epilogue's block stores (_store_block) work with
                copies = (warp, mma_tidx, strip_regs, r2s_d, r2s_dt)
                epi_tiles = (sD_strips, sDT_strips)
                mirror_views = (sD_chunks, sDT_as_D, upper, lower) if cutlass.const_expr(self.mirror) else ()
                stores = (tma_d, tDsD, tDgD, tma_dt, tTsT, tTgT)
                t = first
                while t < total:
                    batch, ti, tj, i = _tile_at(tiles, t, per_batch, self.cm, rank)
                    # the accumulator starts from zero; with skip_rows only the skipping path
                    # reads the zeros. Where they are written is what ptxas needs: filled here,
                    # X X^T's kernel (no C) has its wgmmas serialized; filled in the skipping
                    # path, the kernels with C spill.
                    fill_in_skip = self.skip_rows and not self.has_c
                    if cutlass.const_expr(not fill_in_skip):
                        acc.fill(0.0)
                    # which of ``variants`` this tile runs: one branch per tile, around its k-loops
                    # (None: no product, the warpgroup's rows of A being zero)
                    variants = products + ([None] if cutlass.const_expr(self.skip_rows) else [])
                    variant = cutlass.Int32(0)
                    if cutlass.const_expr(self.half_diagonal):
                        if ti == tj and rank == 0:
                            variant = cutlass.Int32(1)
                    if cutlass.const_expr(self.skip_rows):
                        if i * TILE + (wg - 1) * WG_ROWS >= zero_from:
                            variant = cutlass.Int32(len(products))
                    # with C the k-loops run in two segments: between them the store warp frees
                    # the epilogue tiles, the previous tile's stores having long been issued
                    splits = (c_split,) if cutlass.const_expr(self.has_c) else ()
                    for v in cutlass.range_constexpr(len(variants)):
                        multiplies = variants[v] is not None
                        # bound outside the branch, which CuteDSL would otherwise make yield them
                        mma, acc_v, frag_a, frag_b = variants[v] if multiplies else products[0]
                        if variant == v:
                            if cutlass.const_expr(multiplies):
                                # With skip_rows the first product overwrites the accumulator, so
                                # that only the skipping path reads the zeros: ptxas then folds
                                # the fill into each multiplying path's first wgmma, as it does
                                # when every path multiplies (without it, it zeroes the registers
                                # every tile and the first wgmma reads them).
                                mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, not self.skip_rows)
                                cute.nvgpu.warpgroup.fence()
                                # k-step 0 peeled; every later one releases the stage before the
                                # one it issued (one wgmma batch in flight). No data-dependent
                                # branch inside the k-loops: C's release point tested at every
                                # step cost ~20 ns a step. The k-step is written out in the loop
                                # itself: CuteDSL carries the pipeline states through a loop only
                                # when its body advances them (a helper that advances them
                                # compiles to different code).
                                ring.consumer_wait(read)
                                for kb in cutlass.range_constexpr(k_blocks):
                                    a_kb, b_kb = (
                                        frag_a[(None, None, kb, read.index)],
                                        frag_b[(None, None, kb, read.index)],
                                    )
                                    cute.gemm(mma, acc_v, a_kb, b_kb, acc_v)
                                    mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                                cute.nvgpu.warpgroup.commit_group()
                                read.advance()
                            elif cutlass.const_expr(fill_in_skip):
                                acc.fill(0.0)
                            # skipping: every slot waited for and released in turn, as the
                            # other warpgroups do (the ring counts every consumer warp of the
                            # cluster)
                            bounds = (1 if multiplies else 0, *splits, k_tiles)
                            for segment in cutlass.range_constexpr(len(bounds) - 1):
                                if segment == 1:
                                    if t != first and warp == _STORE_WARP:
                                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                                        c_pipe.consumer_release(c_free)
                                        c_free.advance()
                                for _kt in cutlass.range(bounds[segment], bounds[segment + 1], unroll=1):
                                    ring.consumer_wait(read)
                                    if cutlass.const_expr(multiplies):
                                        for kb in cutlass.range_constexpr(k_blocks):
                                            a_kb, b_kb = (
                                                frag_a[(None, None, kb, read.index)],
                                                frag_b[(None, None, kb, read.index)],
                                            )
                                            cute.gemm(mma, acc_v, a_kb, b_kb, acc_v)
                                        cute.nvgpu.warpgroup.commit_group()
                                    read.advance()
                                    if cutlass.const_expr(multiplies):
                                        cute.nvgpu.warpgroup.wait_group(1)
                                    ring.consumer_release(release)
                                    release.advance()
                            if cutlass.const_expr(multiplies):
                                cute.nvgpu.warpgroup.wait_group(0)
                                ring.consumer_release(release)
                                release.advance()

                    # epilogue: fp32 math and one rounding per 128 x 128 block (the accumulator
                    # holds a block's values contiguously, the wgmma layout's column chunks
                    # being its outermost mode), C read from shared memory before any block
                    # overwrites it; then per block two shared-memory tiles and TMA stores
                    if cutlass.const_expr(self.has_c):
                        c_pipe.consumer_wait(c_read)
                    for blk in cutlass.range_constexpr(self.cm):
                        # in runs of 32: CuteDSL warns of static loops of 64 steps and more
                        for run in cutlass.range_constexpr(0, per_block, 32):
                            for v in cutlass.range_constexpr(run, min(run + 32, per_block)):
                                block[v] = acc[blk * per_block + v]
                        res = alpha * block.load()
                        if cutlass.const_expr(self.has_c):
                            cute.autovec_copy(tEsC[blk], c_in)
                            res = res + beta * c_in.load().to(self.acc_dtype)
                        outs[blk].store(res.to(self.d_dtype))
                        if cutlass.const_expr(self.check):
                            # the rounded values (a finite float32 can round to inf); NaN
                            # propagates through the max and fails the comparison
                            top = cute.math.absf(outs[blk].load().to(self.acc_dtype)).reduce(
                                cute.ReductionOp.MAX, 0.0, 0
                            )
                            if not top < _INF:
                                flags[batch] = cutlass.Int32(1)
                    if cutlass.const_expr(self.has_c):
                        c_read.advance()
                    if cutlass.const_expr(self.general):
                        # every block is written and stored as computed: block b of the CTA tile
                        # through epilogue tile b, both row-major, after the previous tile's
                        # stores have read them and every thread is done with C's blocks
                        if warp == _STORE_WARP:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=_MMA_THREADS)
                        for blk in cutlass.range_constexpr(self.cm):
                            for strip in cutlass.range_constexpr(strips):
                                for v in cutlass.range_constexpr(per_strip):
                                    strip_regs[v] = rs_outs[blk][strip * per_strip + v]
                                dst = [sD_strips, sDT_strips][blk][(None, None, 0, strip)]
                                cute.copy(r2s_d, strip_regs, r2s_d.partition_D(dst))
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=_MMA_THREADS)
                        if warp == _STORE_WARP:
                            cute.copy(tma_d, tDsD, tDgD[(None, i, tj * self.cm, batch)])
                            if cutlass.const_expr(self.cm > 1):
                                cute.copy(tma_dt, tTsT, tTgT[(None, i, tj * self.cm + 1, batch)])
                            cute.arch.cp_async_bulk_commit_group()
                    else:
                        for blk in cutlass.range_constexpr(self.cm):
                            j = tj * self.cm + blk
                            _store_block(rs_outs[blk], (i, j, batch), copies, epi_tiles, mirror_views, stores)
                    t += nblk
                if warp == _STORE_WARP:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    return SymGemmSm90
