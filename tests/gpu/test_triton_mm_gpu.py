"""The persistent TMA GEMM (kernels/triton_mm.py) on a CUDA GPU against a float64 reference,
the Triton backend's general products through it, and standard Newton-Schulz on it."""

import pytest
import torch

from tests.flagged import assert_flags_the_poisoned, poisoned_operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = (torch.float16, torch.bfloat16)
# triton_mm.Config (BLOCK_M, BLOCK_N, BLOCK_K, GROUP, warps, stages[, split, ws]): the default,
# a 128 x 128 tile, the epilogue in two halves with a fourth stage, warp-specialized
CONFIGS = [
    (128, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 5),
    (128, 256, 64, 8, 8, 4, True),
    (128, 256, 64, 8, 8, 3, False, True),
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("shape", [(3, 256, 512, 512), (1, 1024, 768, 2048), (2, 384, 128, 256)], ids=str)
@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("with_c", [False, True])
def test_mm_tma(dtype, config, shape, layout, with_c, seed: int) -> None:
    from dion3_titan.kernels import triton_mm

    L, M, K, N = shape
    a, b, c = (torch.randn(*s, device="cuda").to(dtype) for s in [(L, M, K), (L, K, N), (L, M, N)])
    if layout == "cols":  # a weight's columns: unit stride along rows
        a, b, c = (t.mT.contiguous().mT for t in (a, b, c))
    alpha, beta = (0.75, -1.25) if with_c else (1.0, 0.0)
    ref = alpha * torch.bmm(a.double(), b.double()) + (beta * c.double() if with_c else 0)
    theirs = torch.baddbmm(c, a, b, alpha=alpha, beta=beta) if with_c else torch.bmm(a, b)
    out = torch.full((L, M, N), float("nan"), device="cuda", dtype=dtype)
    assert triton_mm.mm_tma(a, b, c if with_c else None, alpha, beta, config=config, out=out) is out
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert _rel_err(out, ref) <= 2 * _rel_err(theirs, ref) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("with_c", [False, True])
def test_mm_tma_flags_the_nonfinite_matrices(dtype, config, with_c: bool, seed: int) -> None:
    """``flags``: exactly the matrices whose rounded result holds a NaN or inf (a NaN in C, an
    inf in A, a product beyond the dtype's range) are flagged, a flag already set stays set,
    and the result has the unchecked kernel's bits."""
    from dion3_titan.kernels import triton_mm

    a, b, c = poisoned_operands(4, 256, 384, 512, dtype)
    c, beta = (c, 0.5) if with_c else (None, 0.0)
    assert_flags_the_poisoned(
        lambda flags: triton_mm.mm_tma(a, b, c, 1.0, beta, config=config, flags=flags), with_c, seed
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backend_products_through_the_tma_gemm(dtype, seed: int, monkeypatch) -> None:
    """TritonOps.mm / mm_add with both switches on give the float64 result to the dtype's
    accuracy, C the second operand itself as in X <- a X + B X; off the block grid they fall
    back to cuBLAS."""
    from dion3_titan.kernels import triton_mm
    from dion3_titan.kernels.triton_ops import TritonOps

    monkeypatch.setattr(triton_mm, "MM_CONFIG", triton_mm.Config(*CONFIGS[0]))
    monkeypatch.setattr(triton_mm, "MM_ADD_CONFIG", triton_mm.Config(*CONFIGS[0]))
    monkeypatch.setattr(triton_mm, "MM_ADD_MIN_TILES_PER_SM", 0)  # these small shapes too
    ops = TritonOps()
    for n, m in [(512, 512), (384, 1024), (200, 640)]:
        p = torch.randn(4, n, n, device="cuda").to(dtype) / n**0.5
        x = torch.randn(4, n, m, device="cuda").to(dtype)
        ref = torch.bmm(p.double(), x.double())
        assert _rel_err(ops.mm(p, x), ref) <= 2 * _rel_err(torch.bmm(p, x), ref) + 1e-6
        ref_add = ref + 1.875 * x.double()
        theirs = torch.baddbmm(x, p, x, beta=1.875)
        assert _rel_err(ops.mm_add(p, x, x, 1.0, 1.875), ref_add) <= 2 * _rel_err(theirs, ref_add) + 1e-6


def test_standard_ns_on_triton_matches_torch(seed: int, monkeypatch) -> None:
    """Standard NS (square shapes, "auto") with X <- a X + B X in the TMA GEMM (its default
    config; the size rule lifted here): as accurate against float64 as the torch backend in fp16, for either memory order
    of X, each of the five steps' products through the kernel."""
    from dion3_titan.kernels import get_backend, triton_mm
    from dion3_titan.optim.config import Dion3Config
    from dion3_titan.optim.orthogonalize import NSSettings, orthogonalize

    ran = []
    mm_tma = triton_mm.mm_tma

    def spy(*args, **kwargs):
        out = mm_tma(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(triton_mm, "mm_tma", spy)
    monkeypatch.setattr(triton_mm, "MM_ADD_MIN_TILES_PER_SM", 0)  # 8 x 1024^2 is under the rule's size
    cfg = Dion3Config()
    fp16 = NSSettings("auto", cfg.coefficients(), cfg.ns_restarts, torch.float16, cfg.ns_eps)
    fp64 = NSSettings("auto", cfg.coefficients(), cfg.ns_restarts, torch.float64, cfg.ns_eps)
    x = torch.randn(8, 1024, 1024, device="cuda")
    for batch in (x, x.mT.contiguous().mT):
        want = orthogonalize(batch.double(), fp64, get_backend("torch"))
        ours = orthogonalize(batch, fp16, get_backend("triton"))
        theirs = orthogonalize(batch, fp16, get_backend("torch"))
        assert _rel_err(ours, want) <= 1.25 * _rel_err(theirs, want) + 1e-3
    assert ran == [True] * 10, ran  # 5 steps x 2 layouts
