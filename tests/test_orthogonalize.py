"""Newton-Schulz orthogonalization: Gram NS (paper Alg. 3) vs standard NS vs the exact
polynomial, fp16 stability with the restart after iteration 2 (App. B.2), the injected
-4e-4 Gram eigenvalue of App. B.2.1, and the non-finite result check (optim/nonfinite.py)."""

import pytest
import torch

from dion3_titan.kernels.torch_ops import TorchOps
from dion3_titan.optim import orthogonalize as orthogonalize_module
from dion3_titan.optim.config import POLAR_EXPRESS, Dion3Config, coefficient_schedule
from dion3_titan.optim.nonfinite import NonfiniteGuard
from dion3_titan.optim.orthogonalize import (
    NSSettings,
    ResultCheck,
    gram_newton_schulz,
    is_transposed_batch,
    normalize_batch,
    orthogonalize,
    runs_in_halves,
    standard_newton_schulz,
)
from tests.reference import ns_polynomial_via_svd

pytestmark = pytest.mark.timeout(120)

PE = Dion3Config().coefficients()  # polar_express, 5 steps, safety factor 1.05
MUON = coefficient_schedule("muon", 5, 1.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


# ------------------------------------------------------------------------------ float64 agreement
@pytest.mark.parametrize("coeffs", [PE, MUON], ids=["polar_express", "muon"])
@pytest.mark.parametrize("restarts", [(2,), (), (1, 3)], ids=["restart2", "norestart", "restart1_3"])
def test_gram_equals_standard_float64(coeffs, restarts):
    """Gram NS and standard NS are the same polynomial: in float64 they agree to 1e-9 relative,
    for aspect ratios 1..16, wide and tall, batch > 1; both equal U p(S) V^T from an SVD."""
    g = torch.Generator().manual_seed(1234)
    ops = TorchOps()
    gram = NSSettings("gram", coeffs, restarts, torch.float64)
    std = NSSettings("standard", coeffs, (), torch.float64)
    for ratio in (1, 2, 4, 8, 16):
        for tall in (False, True):
            n = 12
            shape = (3, n * ratio, n) if tall else (3, n, n * ratio)
            x = torch.randn(*shape, generator=g, dtype=torch.float64)
            a = orthogonalize(x, gram, ops)
            b = orthogonalize(x, std, ops)
            assert a.shape == x.shape and a.dtype == torch.float64
            assert _rel(a, b) < 1e-9, (ratio, tall)
            assert _rel(a, ns_polynomial_via_svd(x, coeffs)) < 1e-9, (ratio, tall)


def test_gram_kernel_direct_matches_polynomial():
    """gram_newton_schulz / standard_newton_schulz called directly on a normalized wide batch."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 10, 50, generator=g, dtype=torch.float64)
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    ref = ns_polynomial_via_svd(x, PE, eps=0.0)
    assert _rel(gram_newton_schulz(x, PE, (2,), TorchOps()), ref) < 1e-10
    assert _rel(standard_newton_schulz(x, PE, TorchOps()), ref) < 1e-10


def test_result_is_near_orthogonal_float64():
    """Not just self-consistent: for a well-conditioned input, PE's 5 steps land near polar(X)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 64, generator=g, dtype=torch.float64)
    out = orthogonalize(x, NSSettings("gram", PE, (2,), torch.float64), TorchOps())
    sv = torch.linalg.svdvals(out)
    assert sv.min() > 0.8 and sv.max() < 1.2
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    assert _rel(out, u @ vh) < 0.15


# ------------------------------------------------------------------------------ fp16 stability
def _inputs(kind: str, b: int, n: int, m: int, g: torch.Generator) -> torch.Tensor:
    if kind == "gauss":
        return torch.randn(b, n, m, generator=g)
    if kind == "rankdef":  # rank n/4 (of the smaller side)
        r = max(1, min(n, m) // 4)
        return torch.randn(b, n, r, generator=g) @ torch.randn(b, r, m, generator=g)
    assert kind == "expdecay"  # singular values exp(-rate i), down to ~1e-6 of the largest
    k = min(n, m)
    u, _ = torch.linalg.qr(torch.randn(b, n, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(b, m, k, generator=g))
    rate = (torch.rand(b, 1, generator=g) * 12 + 1) / k
    s = torch.exp(-rate * torch.arange(k))
    return (u * s[:, None, :]) @ v.mT


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    """Singular values (B, min(n, m)), descending, from the eigenvalues of the smaller Gram
    matrix in float64 (cheaper than an SVD; accurate for values >~ 1e-6 of the largest)."""
    xd = x.double()
    gram = xd @ xd.mT if x.shape[-2] <= x.shape[-1] else xd.mT @ xd
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(-1)


def _expected_singular_values(x: torch.Tensor, coeffs) -> torch.Tensor:
    """Exact-arithmetic output singular values (descending) of NS on x (B, n, m)."""
    xd = x.double()
    s = _singular_values(xd / torch.linalg.vector_norm(xd, dim=(-2, -1), keepdim=True))
    for a, b, c in coeffs:
        s = a * s + b * s**3 + c * s**5
    return s.sort(dim=-1, descending=True).values


# (batch, n, m): 330 inputs in all, Gram side up to 256, wide, tall and square (-> standard NS).
FP16_CASES = [
    (2, 256, 384),
    (4, 384, 128),
    (4, 128, 256),
    (4, 128, 128),
    (16, 64, 192),
    (16, 192, 64),
    (32, 32, 128),
    (32, 16, 128),
]


def test_fp16_default_settings_are_stable():
    """Default settings (fp16, polar_express with safety 1.05, restart after iteration 2): no
    NaN/Inf; every output singular value <= 1.3; those that exact arithmetic takes to >= 0.7
    are >= 0.6. Gaussian, rank-deficient and exponentially decaying spectra."""
    cfg = Dion3Config()
    assert cfg.ns_dtype == "float16" and cfg.ns_restarts == (2,) and cfg.ns_safety_factor == 1.05
    settings = NSSettings(cfg.ns_algorithm, cfg.coefficients(), cfg.ns_restarts, torch.float16, cfg.ns_eps)
    g = torch.Generator().manual_seed(2024)
    count = 0
    for b, n, m in FP16_CASES:
        for kind in ("gauss", "rankdef", "expdecay"):
            x = _inputs(kind, b, n, m, g)
            out = orthogonalize(x, settings, TorchOps())
            assert out.dtype == torch.float16 and out.shape == x.shape
            assert torch.isfinite(out).all(), (b, n, m, kind)
            sv = _singular_values(out)  # descending
            expected = _expected_singular_values(x, cfg.coefficients())
            assert sv.max() <= 1.3, (b, n, m, kind, sv.max().item())
            big = expected >= 0.7
            assert big.any()
            assert sv[big].min() >= 0.6, (b, n, m, kind, sv[big].min().item())
            count += b
    assert count >= 200


def test_fp16_without_restart_blows_up():
    """The failure the restart prevents, in fp16 itself: the same rank-deficient / decaying
    inputs through Gram NS without the restart give singular values far above 1 (or NaN)."""
    g = torch.Generator().manual_seed(5)
    x = torch.cat([_inputs("rankdef", 32, 32, 128, g), _inputs("expdecay", 32, 32, 128, g)])
    with_restart = orthogonalize(x, NSSettings("gram", PE, (2,), torch.float16), TorchOps())
    without = orthogonalize(x, NSSettings("gram", PE, (), torch.float16), TorchOps()).float()
    assert torch.linalg.svdvals(with_restart.float()).max() <= 1.3
    worst = torch.linalg.svdvals(torch.nan_to_num(without, nan=1e4, posinf=1e4, neginf=-1e4)).max()
    assert worst > 3.0


class InjectedNegativeGram(TorchOps):
    """Every Gram matrix R = X X^T that NS forms gets -4e-4 I (paper App. B.2.1's simulation of
    fp16 rounding: a spurious negative eigenvalue). ``sym_mm`` is only used to form Grams."""

    def __init__(self, shift: float = 4e-4):
        self.shift = shift
        self.grams = 0

    def sym_mm(self, a, b, zero_from=None):
        self.grams += 1
        r = torch.bmm(a, b)
        return r - self.shift * torch.eye(r.shape[-1], dtype=r.dtype)


def _with_tiny_directions(g: torch.Generator) -> torch.Tensor:
    """(4, 16, 64) float64 with 13 singular values in [1e-2, 1] and three of 1e-4, 3e-4, 1e-3:
    their squares (<= 1e-6) turn into Gram eigenvalues near -4e-4 under the injected shift."""
    n, m = 16, 64
    u, _ = torch.linalg.qr(torch.randn(4, n, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(4, m, n, generator=g, dtype=torch.float64))
    s = torch.cat(
        [torch.logspace(0, -2, n - 3, dtype=torch.float64), torch.tensor([1e-3, 3e-4, 1e-4], dtype=torch.float64)]
    )
    return (u * s) @ v.mT


def test_injected_negative_gram_eigenvalue_needs_restart():
    """App. B.2.1 in float64: with R0 (and every re-formed R) shifted by -4e-4 I, the
    un-restarted iteration diverges (the negative eigenvalue grows each step), while the restart
    after iteration 2 keeps every output singular value bounded near [0, 1]."""
    g = torch.Generator().manual_seed(11)
    x = _with_tiny_directions(g)

    ops = InjectedNegativeGram()
    bounded = orthogonalize(x, NSSettings("gram", PE, (2,), torch.float64), ops)
    assert ops.grams == 2  # R0 and the restart's R2: the restart really re-formed the Gram
    assert torch.isfinite(bounded).all()
    sv = torch.linalg.svdvals(bounded)
    assert sv.max() < 1.3
    assert (sv[:, :10] > 0.6).all()  # the well-conditioned part still converges

    ops = InjectedNegativeGram()
    diverged = orthogonalize(x, NSSettings("gram", PE, (), torch.float64), ops)
    assert ops.grams == 1
    sv_bad = torch.linalg.svdvals(torch.nan_to_num(diverged, nan=1e30, posinf=1e30, neginf=-1e30))
    assert sv_bad.max() > 1e3

    # The kernel itself (no wrapper): Q_5 X_0 without restarts is huge along the negative direction.
    ops = InjectedNegativeGram()
    xn = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    q_only = gram_newton_schulz(xn, PE, (), ops)
    assert torch.linalg.svdvals(q_only).max() > 1e3


# ------------------------------------------------------------------------------ non-finite NS results
def orthogonalize_checked(x, settings, backend):
    """orthogonalize, then the optimizer's non-finite check on its result (one batch)."""
    out = orthogonalize(x, settings, backend)
    guard = NonfiniteGuard("raise")
    out, bad = guard.orthogonalized(out)
    guard.count_ns(bad)
    return out, bad


class CorruptFirstGram(TorchOps):
    """Corrupts matrix ``which`` of the batch in the first ``times`` Gram products."""

    def __init__(self, which: int, times: int):
        self.which, self.times, self.calls = which, times, 0

    def sym_mm(self, a, b, zero_from=None):
        r = torch.bmm(a, b)
        if self.calls < self.times and r.shape[0] > self.which:
            r = r.clone()
            r[self.which, 0, 0] = float("inf")
        self.calls += 1
        return r


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_checked_zeroes_a_corrupted_matrix_only(dtype, seed):
    """A matrix whose Newton-Schulz result is not finite becomes zero (its update subtracts
    nothing this step) and is flagged; the other matrices of the batch keep their bits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 8, 24, generator=g)
    settings = NSSettings("gram", PE, (2,), dtype)
    clean = orthogonalize(x, settings, TorchOps())
    # sanity: the corruption really makes the plain call non-finite
    assert not torch.isfinite(orthogonalize(x, settings, CorruptFirstGram(1, 1))).all()

    out, bad = orthogonalize_checked(x, settings, CorruptFirstGram(1, 1))
    assert bad.tolist() == [False, True, False], f"seed {seed}"
    assert out.dtype == dtype and torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2]), f"seed {seed}"


def test_checked_never_returns_nonfinite_for_inf_input(seed):
    """An input with inf cannot be orthogonalized at all: the result must still be finite
    (zero, i.e. no update) and flagged, never NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 8, 24, generator=g)
    x[1, 2, 3] = float("inf")
    settings = NSSettings("gram", PE, (2,), torch.float16)
    out, bad = orthogonalize_checked(x, settings, TorchOps())
    assert bad.tolist() == [False, True, False]
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], orthogonalize(x[[0, 2]], settings, TorchOps())[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_row_sums_flag_the_same_matrices_as_the_max_pass(dtype, seed):
    """The result check taken from the rows' float32 sums of squares (which NorMuon's epilogue
    computes anyway) flags exactly the matrices the max-|x| pass flags: NaN, +-inf, and none
    of the finite ones, fp16's largest value included; the max pass alike on a transposed view."""
    from dion3_titan.optim.nonfinite import nonfinite_matrices

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 16, 512, generator=g).to(dtype)
    x[1, 3, 7] = float("nan")
    x[2, 15, 511] = float("inf")
    x[3, 0, 0] = float("-inf")
    x[4] = torch.finfo(torch.float16).max  # every entry as large as fp16 holds: still finite
    row_sq = x.float().square().sum(-1)
    want = [False, True, True, True, False, False]
    assert nonfinite_matrices(x).tolist() == want, f"seed {seed}"
    assert nonfinite_matrices(x, row_sq).tolist() == want, f"seed {seed}"
    # a tall batch's result as NS hands it back (a transposed view): the same flags
    assert nonfinite_matrices(x.mT.contiguous().mT).tolist() == want, f"seed {seed}"


def test_polar_express_schedule_and_safety_factor():
    """Coefficient schedule: PE's per-step triples with p(x) -> p(x / 1.05); later steps repeat
    the last polynomial; Muon's quintic is constant."""
    coeffs = coefficient_schedule("polar_express", 10, 1.05)
    for t, (a, b, c) in enumerate(coeffs):
        a0, b0, c0 = POLAR_EXPRESS[min(t, len(POLAR_EXPRESS) - 1)]
        x = 0.37
        assert (
            abs((a * x + b * x**3 + c * x**5) - (a0 * (x / 1.05) + b0 * (x / 1.05) ** 3 + c0 * (x / 1.05) ** 5)) < 1e-12
        )
    assert coefficient_schedule("muon", 3, 1.0) == ((3.4445, -4.7750, 2.0315),) * 3


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_normalize_batch_equals_concatenate_then_normalize(transposed, dtype):
    """The single-rank fast path (normalize each momentum view straight into the NS batch) gives
    exactly what concatenating the views and normalizing the batch gives, in the same layout."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, 5, 9), (1, 5, 9), (3, 5, 9)]
    if transposed:  # views that select a weight's columns: transposes of contiguous tensors
        views = [torch.randn(b, m, n, generator=gen).mT for b, n, m in shapes]
    else:
        views = [torch.randn(b, n, m, generator=gen) for b, n, m in shapes]
    got = normalize_batch(views, 1e-7, dtype)
    # the concatenation in the views' own memory order (as the step's packing does it)
    batch = torch.cat([v.mT for v in views]).mT if transposed else torch.cat(views)
    want = TorchOps().normalize(batch, 1e-7, dtype, batch.shape[1])
    assert got.dtype == dtype and got.shape == (6, 5, 9)
    assert is_transposed_batch(views) == transposed == (not got.is_contiguous())
    assert torch.equal(got, want)
    norms = torch.linalg.vector_norm(got.double(), dim=(-2, -1))
    assert torch.allclose(norms, torch.ones(6, dtype=torch.float64), atol=1e-3)


@pytest.mark.parametrize("side", [10, 16], ids=["exact", "padded"])
def test_tall_gram_result_is_laid_out_as_the_callers_rows(side, seed):
    """A tall batch's Gram NS result comes back as X^T Q (= (Q X)^T, Q symmetric) computed
    directly: row-major in the caller's (B, m, n) orientation, so the finiteness check and the
    update read it row by row instead of down columns; the values are the polynomial's, as for
    the wide product (float64), with or without the backend's padded Gram side."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 50, 10, generator=g, dtype=torch.float64)
    settings = NSSettings("gram", PE, (2,), torch.float64)
    ops = TorchOps() if side == 10 else PaddedSideOps()
    out = orthogonalize(x, settings, ops)
    assert out.shape == x.shape and out.stride(-1) == 1, f"seed {seed}: strides {out.stride()}"
    assert _rel(out, ns_polynomial_via_svd(x, PE)) < 1e-10, f"seed {seed}"
    wide = orthogonalize(x.mT.contiguous(), settings, ops)
    assert _rel(out, wide.mT) < 1e-12, f"seed {seed}"
    xn = x.mT / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    direct = gram_newton_schulz(xn, PE, (2,), TorchOps(), column_major=True)
    assert direct.shape == xn.shape and direct.mT.is_contiguous()
    assert _rel(direct, gram_newton_schulz(xn, PE, (2,), TorchOps())) < 1e-12, f"seed {seed}"


# ------------------------------------------------------------------------------ Gram-side padding
class PaddedSideOps(TorchOps):
    """The torch backend asking for Gram sides rounded up to a multiple of ``side`` and, with
    ``depth``, reading the products over them only to the real side rounded up to a multiple of
    ``depth`` (``Backend.gram_side``, ``gram_depth``). ``inner`` records the inner dimension of
    every product it makes."""

    def __init__(self, side: int = 16, depth: int | None = None) -> None:
        self.side, self.depth, self.inner, self.zero_from = side, depth, [], []

    def gram_side(self, n: int) -> int:
        return -(-n // self.side) * self.side

    def gram_depth(self, n: int) -> int:
        side = self.gram_side(n)
        return side if self.depth is None else min(side, -(-n // self.depth) * self.depth)

    def mm(self, a, b, out=None):
        self.inner.append(a.shape[-1])
        return super().mm(a, b, out)

    def mm_add(self, a, b, c, alpha, beta, out=None):
        self.inner.append(a.shape[-1])
        return super().mm_add(a, b, c, alpha, beta, out)

    def sym_mm(self, a, b, zero_from=None):
        self.inner.append(a.shape[-1])
        return super().sym_mm(self._zero_rows_left_out(a, zero_from), b)

    def sym_addmm(self, a, b, c, alpha, beta, zero_from=None):
        self.inner.append(a.shape[-1])
        return super().sym_addmm(self._zero_rows_left_out(a, zero_from), b, c, alpha, beta)

    def _zero_rows_left_out(self, a, zero_from):
        """a as a kernel that skips the rows named zero sees it: those rows are zero (the
        caller's guarantee, checked) and their products are left out (zeros in their place)."""
        self.zero_from.append(zero_from)
        if zero_from is None or zero_from >= a.shape[-2]:
            return a
        assert not a[:, zero_from:].any(), f"rows from {zero_from} on are not zero"
        kept = torch.zeros_like(a)
        kept[:, :zero_from] = a[:, :zero_from]
        return kept


@pytest.mark.parametrize("algorithm", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(3, 37, 90), (2, 90, 37), (2, 40, 40)], ids=["wide", "tall", "square"])
def test_padding_to_the_backends_gram_side_changes_nothing(algorithm, shape, seed):
    """A backend that runs at a larger Gram side (Triton: whole 128-row tiles) gets zero rows
    added by ``orthogonalize``: the result has the input's shape and equals the unpadded run in
    float64 to rounding, in either orientation; "auto" still resolves on the real shape (square:
    standard NS)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    settings = NSSettings(algorithm, PE, (2,), torch.float64)
    plain = orthogonalize(x, settings, TorchOps())
    padded = orthogonalize(x, settings, PaddedSideOps())
    assert padded.shape == x.shape
    assert _rel(padded, plain) < 1e-12, f"seed {seed}"
    auto = NSSettings("auto", PE, (2,), torch.float64)
    square = torch.randn(2, 40, 40, generator=g, dtype=torch.float64)
    standard = orthogonalize(square, NSSettings("standard", PE, (2,), torch.float64), TorchOps())
    assert _rel(orthogonalize(square, auto, PaddedSideOps()), standard) < 1e-12, f"seed {seed}"


@pytest.mark.parametrize("algorithm", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(3, 37, 90), (2, 90, 37), (2, 37, 37)], ids=["wide", "tall", "square"])
def test_products_over_a_padded_side_skip_its_zero_rows(algorithm, shape, seed):
    """Where the backend reads the products over a padded Gram side only to its depth (CuteDSL:
    whole k-slices), every product but X X^T has that inner dimension, and the result equals
    the run reading the whole side in float64 to rounding: the rows skipped are zero, and Q's
    padded block (a I) only ever meets zero rows of Z or X."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    settings = NSSettings(algorithm, PE, (2,), torch.float64)
    whole, skipping = PaddedSideOps(32), PaddedSideOps(32, depth=8)
    want, got = orthogonalize(x, settings, whole), orthogonalize(x, settings, skipping)
    assert got.shape == x.shape
    assert _rel(got, want) < 1e-12, f"seed {seed}"
    n, m = sorted(shape[1:])
    assert set(whole.inner) == {64, m} and set(skipping.inner) == {40, m}, (whole.inner, skipping.inner)
    assert len(skipping.inner) == len(whole.inner)
    # every symmetric product names the rows from the depth on as zero (checked by the backend)
    assert set(skipping.zero_from) == {40} and set(whole.zero_from) == {64}, (skipping.zero_from, whole.zero_from)


@pytest.mark.parametrize("normalized", [False, True])
def test_a_batch_packed_at_the_gram_side_names_its_rows(normalized, seed):
    """A caller that packs a wide batch at the backend's Gram side (the optimizer's step) passes
    its real rows: the result has those rows and equals the unpadded input's, the products skip
    the padding as for a batch padded here; a tall batch cannot name rows; an empty batch (a
    replica's empty share) comes back with the real rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 37, 90, generator=g, dtype=torch.float64)
    settings = NSSettings("gram", PE, (2,), torch.float64)
    if normalized:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    want = orthogonalize(x, settings, TorchOps(), normalized=normalized)
    ops = PaddedSideOps(32, depth=8)
    packed = torch.nn.functional.pad(x, (0, 0, 0, 64 - 37))
    got = orthogonalize(packed, settings, ops, tall=False, normalized=normalized, rows=37)
    assert got.shape == x.shape and _rel(got, want) < 1e-12, f"seed {seed}"
    assert set(ops.inner) == {40, 90}, ops.inner
    with pytest.raises(ValueError, match="rows"):
        orthogonalize(packed.mT, settings, ops, tall=True, rows=37)
    empty = orthogonalize(packed[:0], settings, ops, tall=False, normalized=normalized, rows=37)
    assert empty.shape == (0, 37, 90)


def test_cute_reads_a_padded_side_to_whole_k_slices(monkeypatch):
    """CuteDSL's products over a padded Gram side read to the real side rounded up to its
    k-slice: 2752 (7B's w1/w3 rows at f = 1/4) at its side 2816 reads 2752; sides that are
    whole tiles, or whose padding is less than a k-slice, read the whole side; with
    SKIP_PADDING off, every side. (The instance is made without its constructor's GPU check:
    the rule is host arithmetic.)"""
    from dion3_titan.kernels import cute_symm

    ops = object.__new__(cute_symm.CuteOps)
    sides = (100, 1000, 1376, 2752, 2816, 4096)
    assert [ops.gram_side(n) for n in sides] == [100, 1024, 1408, 2816, 2816, 4096]
    assert [ops.gram_depth(n) for n in sides] == [100, 1024, 1408, 2752, 2816, 4096]
    monkeypatch.setattr(cute_symm, "SKIP_PADDING", False)
    assert [ops.gram_depth(n) for n in sides] == [100, 1024, 1408, 2816, 2816, 4096]


def test_triton_gram_side_is_whole_tiles():
    """Triton pads a Gram side above one tile to whole 128-row tiles (the persistent kernel's
    condition) and leaves smaller ones alone."""
    from dion3_titan.kernels.triton_ops import TritonOps

    ops = TritonOps()
    assert [ops.gram_side(n) for n in (64, 128, 129, 2752, 2816, 4096)] == [64, 128, 256, 2816, 2816, 4096]


# ------------------------------------------------------------------------------ halves on two streams
class _FlaggingOps(TorchOps):
    """The torch backend with a checked product, flagging as a kernel's epilogue would."""

    def mm_checked(self, a, b, c, alpha, beta, flags, out=None):
        result = self.mm(a, b, out) if c is None else self.mm_add(a, b, c, alpha, beta, out)
        flags[~torch.isfinite(result).flatten(1).all(1)] = 1
        return result


@pytest.mark.parametrize("steps", [5, 0], ids=["five", "none"])
@pytest.mark.parametrize("algorithm", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(5, 12, 40), (5, 40, 12), (4, 16, 16)], ids=["wide", "tall", "square"])
def test_halves_are_bit_identical_to_one_batch(steps, algorithm, shape, seed, monkeypatch):
    """A batch run in two halves (each on a stream of its own on a GPU, one after the other
    here) gives the one-batch result bit for bit, in the same memory order, and the last
    product's flags of both halves joined (a matrix of the second half made non-finite); with
    no iterations the halves' results are their normalized inputs, copied into one batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[3, 1, 2] = float("inf")
    settings = NSSettings(algorithm, PE[:steps], (2,), torch.float32)
    ops = _FlaggingOps()
    assert not runs_in_halves(x), "the default threshold keeps small batches whole"
    whole_check, halves_check = ResultCheck(), ResultCheck()
    whole = orthogonalize(x, settings, ops, check=whole_check)
    monkeypatch.setattr(orthogonalize_module, "HALVES_MIN_FLOPS", 0)
    halves = orthogonalize(x, settings, ops, check=halves_check)
    torch.testing.assert_close(halves, whole, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")
    if steps:  # (with none, the one batch is the normalized input, in its memory order)
        assert halves.stride() == whole.stride(), f"seed {seed}"
        assert halves_check.bad.tolist() == whole_check.bad.tolist() == [False, False, False, True, False][: shape[0]]
    else:  # no product ran: nothing flagged (the caller checks the result itself)
        assert halves_check.bad is None and whole_check.bad is None


def test_halves_only_where_they_pay():
    """Halves where a half's X X^T is at least HALVES_MIN_FLOPS (32 x 2048^2, 16 x 2816 x 4096),
    not for one matrix, small products (the 7B shapes' 1024-row batches) or under ``leave_sms``
    (the step's costliest group beside the others: their work fills the SMs instead)."""
    from dion3_titan.kernels.tma import leave_sms

    def batch(*shape):
        return torch.empty(*shape, device="meta")

    assert runs_in_halves(batch(32, 2048, 2048)) and runs_in_halves(batch(16, 2816, 4096))
    assert not runs_in_halves(batch(1, 8192, 8192))
    assert not runs_in_halves(batch(32, 1024, 4096))
    with leave_sms(1):
        assert not runs_in_halves(batch(32, 2048, 2048))
