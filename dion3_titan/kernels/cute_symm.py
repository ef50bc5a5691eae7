"""Symmetric and general GEMMs on Hopper (SM90) through our CuteDSL kernel
(``cute_symm_sm90``, whose docstring describes it): ``sym_gemm`` (alpha A B + beta C for a
symmetric result, its lower tiles computed and each stored with its transpose), ``gemm`` (the
general mode: every tile, X <- a X + B X of standard Newton-Schulz, optionally flagging the
matrices whose result is not finite) and ``CuteOps``, the backend that sends its products there.

Limits (the backend falls back to Triton outside them): CUDA SM90 only, n a multiple of 128,
k a multiple of 8 and each operand with a unit stride in its n or k mode (TMA's 16-byte rule).
Kernels are compiled once per configuration (``_compiled``) and cached; shapes are dynamic.
CuteDSL is imported lazily: this module imports without it.

Its speed against cuBLAS and against the Triton backend: docs/kernels.md and docs/benchmarks.md.
"""

import functools
import importlib.util
from typing import Any

import torch

from dion3_titan.kernels.cute_symm_sm90 import TILE, TILE_K, WG_ROWS, kernel_class
from dion3_titan.kernels.launch import cdiv
from dion3_titan.kernels.tma import grid_sms
from dion3_titan.kernels.triton_ops import TritonOps, tile_order

# Tiles in bands of GROUP tile rows, column by column inside a band, so the CTAs running at
# once share A and B panels in L2 (GROUP = 1 is row-major: every CTA of a wave reads its own
# B panel).
GROUP = 8
STAGES = 4  # 4 x 32 KB of A/B slices in shared memory, beside the 2 x 32 KB epilogue tiles
# From a side of PAIR_MIN_N (a multiple of 256) on, two CTAs of a cluster compute a 256 x 256
# tile, 128 x 256 each, the B panel loaded once for both (TMA multicast): half the loads per
# product of a 128 x 128 tile. Their stages hold 48 KB (3 fit beside the epilogue tiles). From
# 2048 on they measured faster than the 128 x 128 form (4% per product at 32 x 2048^2, 5% on
# Newton-Schulz; docs/benchmarks.md, "The diagonal blocks' mirror only where it is needed"), and
# than Triton's wide tiles at 2816 ("Pair tiles from 2048 on, the mirror in 16-byte copies").
PAIR_MIN_N = 2048
PAIR_STAGES = 3
# X <- a X + B X (CuteOps.mm_add) through the general mode (``gemm``): 5% faster than the Triton
# GEMM at 32 x 2048^2 and 8 x 4096^2, level with quack's; 0 leaves it to Triton. Gram NS's Q X
# stays on cuBLAS, level with the general mode there (docs/benchmarks.md, "The general mode of
# the CuteDSL kernel").
GENERAL = 1
# The pair form's diagonal tiles: the first CTA computes only the block it stores (64 x 128
# products on the first half of the B panel), not the block above the diagonal (6% of a
# symmetric product's computed blocks at n = 2048, 4% at 2816). The cluster waits for the second
# CTA either way, so this saves energy, not issue time; Newton-Schulz keeps the card at its power
# limit, where energy is clock: 1-2% per symmetric product at 2048 and 2816 on one H100
# (docs/benchmarks.md, "Half products on the diagonal").
HALF_DIAGONAL = True
# Newton-Schulz's products over a padded Gram side read their operands only up to the real side
# rounded up to whole k-slices (``CuteOps.gram_depth``): the zero rows past it add nothing. At
# 7B's w1/w3 rows at f = 1/4 (2752, padded to 2816) every product after X X^T runs 43 k-slices
# instead of 44: 1.0% of the 7b f = 1/4 step on one H100 (docs/benchmarks.md, "Padded Gram sides
# read to their depth"). False: they read the whole side.
SKIP_PADDING = True
# A symmetric product whose caller names the zero rows of A (``zero_from``: the padding of a Gram
# side, 2752 -> 2816 at 7B's w1/w3 rows at f = 1/4) leaves out the products of the consumer
# warpgroups whose 64 rows all lie there. The cluster still waits for its other CTA, so this
# saves energy, not issue time (as HALF_DIAGONAL): Newton-Schulz at 16 x 2752 x 4096 2-4% faster
# on one H100 (docs/benchmarks.md, "Padding rows' products skipped, the fold kept"). False: they
# multiply the zeros.
SKIP_ZERO_ROWS = True
# The A/B's control (scripts/bench_orthogonalize.py --variants cute_skip_never_taken): the
# kernel with its skipping path compiled, given a bound no warpgroup reaches.
SKIP_NEVER = False


def pairs(n: int) -> bool:
    """Whether a product of side ``n`` runs in the pair form (``cute_symm_sm90``'s docstring)."""
    return n % (2 * TILE) == 0 and n >= PAIR_MIN_N


def is_available() -> bool:
    """CuteDSL importable and the current GPU is Hopper (SM90); builds nothing."""
    if importlib.util.find_spec("cutlass") is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() == (9, 0)


_DTYPES = {torch.float16: "Float16", torch.bfloat16: "BFloat16"}


def _major(s_rows: int, s_k: int, size: int) -> str | None:
    """The memory order of an operand of (rows, k) matrices with these strides and elements of
    ``size`` bytes: 'k' if contiguous along k, 'n' if along its rows, else None (TMA also needs
    the other stride in whole 16 bytes). Read from strides: a view made per product to ask would
    cost more host time than the rest of the launch's checks."""
    if s_k == 1 and (s_rows * size) % 16 == 0:
        return "k"
    if s_rows == 1 and (s_k * size) % 16 == 0:
        return "n"
    return None


@functools.cache
def _compiled(
    dtype_name: str,
    a_major: str,
    b_major: str,
    has_c: bool,
    stages: int = STAGES,
    pair: bool = False,
    mirror: bool = True,
    general: bool = False,
    check: bool = False,
    half_diagonal: bool = False,
    skip_rows: bool = False,
) -> Any:
    """Compile once per configuration; shapes and strides stay dynamic (symbolic). ``general``:
    the (n, m) product of ``gemm`` (m its own size), else the symmetric (n, n) one; ``check``:
    its epilogue flags the matrices whose result is not finite; ``half_diagonal``: a pair's
    diagonal tiles skip the block above the diagonal (``HALF_DIAGONAL``); ``skip_rows``: a
    consumer warpgroup whose rows of A are zero multiplies nothing (``SKIP_ZERO_ROWS``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = getattr(cutlass, dtype_name)
    n, k, L = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int()
    m = cute.sym_int() if general else n

    def strides(unit: int) -> tuple:
        # (L, i, j) with a unit stride in mode ``unit``, the others symbolic
        return tuple(1 if mode == unit else cute.sym_int64(divisibility=8) for mode in range(3))

    # a (L, n, k), its unit stride along k ("k") or n; b (L, k, m), b^T's unit stride along k
    # (b's mode 1) or m; C and D row-major (L, n, m)
    a = make_fake_tensor(dtype, (L, n, k), strides(2 if a_major == "k" else 1), assumed_align=16)
    b = make_fake_tensor(dtype, (L, k, m), strides(1 if b_major == "k" else 2), assumed_align=16)
    c = make_fake_tensor(dtype, (L, n, m), strides(2), assumed_align=16)
    d = make_fake_tensor(dtype, (L, n, m), strides(2), assumed_align=16)
    tiles = make_fake_tensor(cutlass.Int32, (2, cute.sym_int()), (cute.sym_int(), 1))
    flags = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,))
    kernel = kernel_class()(has_c, stages, pair, mirror, general, check, half_diagonal, skip_rows)
    return cute.compile(
        kernel,
        a,
        b,
        c,
        d,
        tiles,
        flags,
        cutlass.Int32(1),
        cutlass.Int32(0),
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


@functools.cache
def _rect_table(rows: int, cols: int, group: int, device: torch.device) -> torch.Tensor:
    """(2, rows * cols) int32 rows/cols of every tile of a general product, in bands of
    ``group`` tile rows, column by column inside a band (the symmetric kernel's order without
    the triangle), so the CTAs running at once share A and B panels in L2."""
    order = [
        (r, c) for band in range(0, rows, group) for c in range(cols) for r in range(band, min(band + group, rows))
    ]
    return torch.tensor(order, dtype=torch.int32).T.contiguous().to(device)


def _same_operand(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the product reads the same matrix on both sides, so that D[r, c] and D[c, r] are
    the same products in the same order and need no mirror: a one view of b^T's memory (X X^T),
    or a and b views of one symmetric matrix S from its origin, S[:n, :k] and S[:k, :n] (A A,
    also read to a depth k < n; S symmetric by sym_gemm's contract: its result is). From shapes
    and strides, without making b^T."""
    if a.data_ptr() != b.data_ptr():
        return False
    (L, n, k), (sa, sb) = a.shape, (a.stride(), b.stride())
    return b.shape == (L, k, n) and (sa == (sb[0], sb[2], sb[1]) or sa == sb)


def _majors(a: torch.Tensor, b: torch.Tensor, sides: tuple[int, ...]) -> tuple[str, str] | None:
    """The memory order of a (L, n, k) and of b^T (b is (L, k, m)) when the kernel takes the
    pair (fp16/bf16 alike, each of ``sides`` a multiple of TILE, k a multiple of 8, a unit stride
    TMA can use, nothing empty); None otherwise (the caller falls back)."""
    L, _, k = a.shape
    if a.dtype not in _DTYPES or b.dtype != a.dtype or L == 0 or k == 0 or k % 8 != 0:
        return None
    for side in sides:
        if side % TILE != 0:
            return None
    sa, sb, size = a.stride(), b.stride(), a.element_size()
    majors = _major(sa[1], sa[2], size), _major(sb[2], sb[1], size)
    return None if None in majors else majors


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    alpha: float,
    beta: float,
    out: torch.Tensor | None,
    majors: tuple[str, str],
    form: tuple[bool, bool, bool],
    table: torch.Tensor,
    flags: torch.Tensor | None = None,
    zero_from: int | None = None,
) -> torch.Tensor:
    """alpha * a @ b (+ beta * c) into ``out`` (a new (L, n, m) tensor if None) by the kernel of
    ``form`` (pair, mirror, general) over the tiles of ``table``; ``flags``: ``gemm``'s;
    ``zero_from``: ``sym_gemm``'s."""
    L, n = a.shape[:2]
    has_c = c is not None and beta != 0.0
    if has_c and (c.stride(2) != 1 or c.dtype != a.dtype):
        c = c.contiguous().to(a.dtype)
    if out is None:
        out = torch.empty((L, n, b.shape[2]), dtype=a.dtype, device=a.device)
    # read here, not bound as defaults: scripts/bench_sym_ab.py --cute-variants switches them
    pair, _, general = form
    check = flags is not None
    half = HALF_DIAGONAL and pair and not general
    stages = PAIR_STAGES if pair else STAGES
    # a warpgroup skips when its first row is at or past zero_from: some must, or the kernel
    # without the skipping path runs
    skip = SKIP_ZERO_ROWS and not general and zero_from is not None and cdiv(zero_from, WG_ROWS) * WG_ROWS < n
    fn = _compiled(_DTYPES[a.dtype], *majors, has_c, stages, *form, check, half, skip)
    cm = 2 if pair else 1
    ctas = cm * min(grid_sms(a.device) // cm, L * table.shape[1])
    flag_arg = flags if check else _unwritten(a.device)
    bound = n if (SKIP_NEVER or not skip) else zero_from
    fn(a, b, c if has_c else out, out, table, flag_arg, ctas, bound, float(alpha), float(beta))
    return out


@functools.cache
def _unwritten(device: torch.device) -> torch.Tensor:
    """The flags argument of a kernel compiled without the check (never read or written)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def sym_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: torch.Tensor | None = None,
    zero_from: int | None = None,
) -> torch.Tensor | None:
    """alpha * a @ b (+ beta * c) for a symmetric result; None when the shape or strides are
    outside the kernel's limits (the caller falls back). ``out``: a contiguous (L, n, n) result
    buffer (tests pass a NaN-filled one). ``zero_from``: a's rows from there on are zero (the
    caller's guarantee), so their products may be left out (``SKIP_ZERO_ROWS``)."""
    n = a.shape[1]
    majors = _majors(a, b, (n,))
    if majors is None:
        return None
    pair = pairs(n)
    form = (pair, not _same_operand(a, b), False)
    table = _tile_table(n // (TILE * (2 if pair else 1)), GROUP, a.device)
    return _launch(a, b, c, alpha, beta, out, majors, form, table, zero_from=zero_from)


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """alpha * a @ b (+ beta * c), a (L, n, k), b (L, k, m), c (L, n, m): the symmetric kernel
    in its general mode (every tile; X <- a X + B X of standard Newton-Schulz). None outside its
    limits (n and m multiples of 128, of 256 for the pair form; as ``sym_gemm`` otherwise).
    ``flags``: an (L,) int32 tensor in which the epilogue sets 1 for each matrix whose result
    holds a NaN or inf (it never clears one)."""
    n, m = a.shape[1], b.shape[2]
    majors = _majors(a, b, (n, m))
    if majors is None or (flags is not None and (flags.shape != (a.shape[0],) or flags.dtype != torch.int32)):
        return None
    pair = pairs(n) and m % (2 * TILE) == 0
    cm = 2 if pair else 1
    table = _rect_table(n // (TILE * cm), m // (TILE * cm), GROUP, a.device)
    return _launch(a, b, c, alpha, beta, out, majors, (pair, False, True), table, flags)


class CuteOps(TritonOps):
    """Symmetric products, alpha A B + beta C (X <- a X + B X) and the checked products
    (``mm_checked``) through the CuteDSL SM90 kernel (Triton outside its limits); A B and the
    fused update as in the Triton backend."""

    name = "cute"

    def __init__(self) -> None:
        if not is_available():
            raise RuntimeError(
                "backend='cute' needs nvidia-cutlass-dsl importable and a Hopper (SM90) CUDA GPU; "
                "use backend='triton' or 'auto'"
            )

    def gram_depth(self, n: int) -> int:
        side = self.gram_side(n)
        return min(side, cdiv(n, TILE_K) * TILE_K) if SKIP_PADDING else side

    def mm_add(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        alpha: float,
        beta: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result = gemm(a, b, c, alpha, beta, out=out) if GENERAL else None
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
        # Gram NS's Q X too: the general mode measured level with cuBLAS there
        result = gemm(a, b, c, alpha, beta, out=out, flags=flags) if GENERAL else None
        return result if result is not None else super().mm_checked(a, b, c, alpha, beta, flags, out)

    def sym_mm(self, a: torch.Tensor, b: torch.Tensor, zero_from: int | None = None) -> torch.Tensor:
        out = sym_gemm(a, b, zero_from=zero_from)
        return out if out is not None else super().sym_mm(a, b)  # shapes off the tile grid

    def sym_addmm(
        self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float, zero_from: int | None = None
    ) -> torch.Tensor:
        out = sym_gemm(a, b, c, alpha, beta, zero_from=zero_from)
        return out if out is not None else super().sym_addmm(a, b, c, alpha, beta)
