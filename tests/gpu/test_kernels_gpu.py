"""Triton kernels on a CUDA GPU: symmetric GEMM against a float64 reference, exact symmetry,
every output element written, and the fused update against the torch reference."""

import pytest
import torch

from dion3_titan.kernels.torch_ops import _fused_update_reference
from tests.flagged import assert_flags_the_poisoned, poisoned_operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = (torch.float16, torch.bfloat16)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _symmetric(L: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    c = torch.randn(L, n, n, device="cuda")
    return ((c + c.mT) / 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("n", [128, 256, 1000, 2048, 4096])
@pytest.mark.parametrize("k", [128, 640, 4096])
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("layout", ["x,x.mT", "xT.mT,xT", "r,r"])
def test_sym_gemm(dtype: torch.dtype, L: int, n: int, k: int, with_c: bool, layout: str, seed: int) -> None:
    from dion3_titan.kernels import triton_ops
    from dion3_titan.kernels.triton_ops import TritonOps

    ops = TritonOps()
    # the operand layouts Gram NS passes: X (L, n, k) row-major or column-major (a weight's
    # columns) with X^T as a view, and square symmetric iterates R @ R
    if layout == "r,r":
        if k != 128:
            pytest.skip("square operands: k = n, one k value suffices")
        a = b = _symmetric(L, n, dtype) / n**0.5
    else:
        x = torch.randn(L, n, k, device="cuda").to(dtype)
        if layout == "xT.mT,xT":
            x = x.mT.contiguous().mT
        a, b = x, x.mT
    ref = torch.bmm(a.double(), b.double())
    c, alpha, beta = None, 1.0, 0.0
    if with_c:
        alpha, beta = 0.75, -1.25
        c = _symmetric(L, n, dtype)
        ref = alpha * ref + beta * c.double()
        theirs = torch.baddbmm(c, a, b, alpha=alpha, beta=beta)
        torch.cuda.synchronize()
        out = ops.sym_addmm(a, b, c, alpha, beta)
    else:
        theirs = torch.bmm(a, b)
        out = ops.sym_mm(a, b)
    bound = 2 * _rel_err(theirs, ref) + 1e-6
    # the backend picks the persistent TMA kernel only for large batches: check it on every
    # shape it accepts too, into a poisoned output
    poisoned = torch.full((L, n, n), float("nan"), device="cuda", dtype=dtype)
    tma = triton_ops.sym_gemm_tma(a, b, c, alpha, beta, out=poisoned)
    assert (tma is None) == (n % 128 != 0)
    for result in [out] + ([tma] if tma is not None else []):
        assert result.dtype == dtype and result.shape == (L, n, n)
        assert torch.isfinite(result).all(), "unwritten or non-finite output"
        assert torch.equal(result, result.mT), "result is not exactly symmetric"
        assert _rel_err(result, ref) <= bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "config",
    [(128, 64, 8, 8, 4, True), (128, 128, 8, 8, 2), (128, 64, 8, 4, 4), (128, 64, 8, 8, 3, False, True)],
    ids=str,
)
def test_sym_gemm_tma_configs(dtype: torch.dtype, config: tuple, seed: int) -> None:
    """The persistent kernel in other configs (warp-specialized; BLOCK_K = 128; 4 warps; wide
    tiles, on an odd number of tile rows too): the float64 result to the dtype's accuracy,
    exactly symmetric, every element of a poisoned output written, for both operand layouts and
    with C."""
    from dion3_titan.kernels import triton_ops

    for L, n, k in [(3, 256, 512), (2, 1024, 768), (2, 384, 256)]:
        x = torch.randn(L, n, k, device="cuda").to(dtype)
        c = _symmetric(L, n, dtype)
        for a, b in [(x, x.mT), (x.mT.contiguous().mT, x.mT.contiguous())]:
            for cc, alpha, beta in [(None, 1.0, 0.0), (c, 0.75, -1.25)]:
                ref = alpha * torch.bmm(a.double(), b.double()) + (beta * c.double() if cc is not None else 0)
                theirs = torch.baddbmm(c, a, b, alpha=alpha, beta=beta) if cc is not None else torch.bmm(a, b)
                out = torch.full((L, n, n), float("nan"), device="cuda", dtype=dtype)
                assert triton_ops.sym_gemm_tma(a, b, cc, alpha, beta, config=config, out=out) is out
                torch.cuda.synchronize()
                assert torch.isfinite(out).all() and torch.equal(out, out.mT)
                assert _rel_err(out, ref) <= 2 * _rel_err(theirs, ref) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sym_gemm_writes_every_element(dtype: torch.dtype, seed: int) -> None:
    """A NaN-filled output must come back finite: every tile, both triangles, was written."""
    from dion3_titan.kernels import triton_ops

    for n in (1000, 1024, 1100):
        x = torch.randn(2, n, 192, device="cuda").to(dtype)
        c = _symmetric(2, n, dtype)
        for cc in (None, c):
            out = torch.full((2, n, n), float("nan"), device="cuda", dtype=dtype)
            triton_ops.sym_gemm(x, x.mT, cc, 1.0, 0.5, out=out)
            assert torch.isfinite(out).all()
        assert torch.equal(out, out.mT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["rows", "transposed"])
@pytest.mark.parametrize("extra", [0, 64])
def test_normalize_matches_the_reference_bitwise(dtype: torch.dtype, layout: str, extra: int, seed: int) -> None:
    """Newton-Schulz's input through the row engine's gather: the same fp16 values, memory
    order and zero rows as the reference's division (the division rounds once in both)."""
    from dion3_titan.kernels.backend import Backend
    from dion3_titan.kernels.triton_ops import TritonOps

    x = torch.randn(5, 2752, 1024, device="cuda") * 3.0
    x = (x if layout == "rows" else x.mT.contiguous().mT).to(dtype)
    ops = TritonOps()
    got = ops.normalize(x, 1e-7, torch.float16, 2752 + extra)
    want = Backend.normalize(ops, x, 1e-7, torch.float16, 2752 + extra)
    assert got.stride() == want.stride()
    assert torch.equal(got, want), f"seed {seed}"
    assert (got[:, 2752:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("decay", [1.0, 0.98])
def test_fused_update(dtype: torch.dtype, decay: float, seed: int) -> None:
    from dion3_titan.kernels.triton_ops import TritonOps

    B, R, C, k = 3, 1000, 777, 250
    base = torch.randn(B, R, 2 * C, device="cuda").to(dtype)
    weight = base[:, :, ::2]  # strided view, as for split fused weights
    rows = torch.stack([torch.randperm(R, device="cuda")[:k] for _ in range(B)])
    update = torch.randn(B, k, C, device="cuda")
    lr = torch.tensor(0.0173, device="cuda")
    dec = torch.tensor(decay, device="cuda")
    expected = weight.clone()
    _fused_update_reference(expected, update, rows, lr, dec)
    untouched = base[:, :, 1::2].clone()
    TritonOps().fused_update(weight, update, rows, lr, dec)
    assert torch.equal(base[:, :, 1::2], untouched), "wrote outside the view"
    if dtype == torch.float32:
        assert torch.equal(weight, expected)
    else:
        ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((weight.float() - expected.float()).abs() <= ulp).all()


def test_fused_update_cuda_graph(seed: int) -> None:
    """lr and decay are read on the device: a captured update follows new values on replay."""
    from dion3_titan.kernels.triton_ops import TritonOps

    ops = TritonOps()
    B, R, C, k = 2, 64, 96, 16
    weight = torch.randn(B, R, C, device="cuda")
    rows = torch.stack([torch.randperm(R, device="cuda")[:k] for _ in range(B)])
    update = torch.randn(B, k, C, device="cuda")
    lr = torch.tensor(0.01, device="cuda")
    dec = torch.tensor(0.99, device="cuda")
    ops.fused_update(weight.clone(), update, rows, lr, dec)  # compile outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ops.fused_update(weight, update, rows, lr, dec)
    torch.cuda.current_stream().wait_stream(stream)
    for lr_value, decay_value in ((0.02, 0.9), (0.005, 1.0)):
        lr.fill_(lr_value)
        dec.fill_(decay_value)
        expected = weight.clone()
        _fused_update_reference(expected, update, rows, lr, dec)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(weight, expected)


# ---------------------------------------------------------------- CuteDSL (SM90) symmetric GEMM
def _cute_ready() -> bool:
    from dion3_titan.kernels.cute_symm import is_available

    return is_available()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("n", [128, 1000, 2048])
@pytest.mark.parametrize("k", [128, 640, 4096])
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("layout", ["x,x.mT", "r,r.mT", "s,s", "r,r.mT:k", "s,s:k"])
def test_cute_sym_gemm(
    dtype: torch.dtype, L: int, n: int, k: int, with_c: bool, layout: str, seed: int, monkeypatch
) -> None:
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    """The 128 x 128 form (one CTA per tile), on every side, the pair form's too: as
    _cute_sym_gemm_checked says; outside the kernel's limits it returns None (the backend falls
    back to Triton)."""
    if layout.startswith("s,s") and k != 640:
        pytest.skip("S @ S has k = n (or n - 64): one case per n")
    from dion3_titan.kernels import cute_symm

    monkeypatch.setattr(cute_symm, "PAIR_MIN_N", 1 << 30)
    got, _, built = _cute_sym_gemm_checked(dtype, L, n, k, with_c, layout, seed, monkeypatch)
    assert (got is None) == (n % cute_symm.TILE != 0), f"seed {seed}"
    assert all(not pair for pair, _ in built), f"the pair kernel ran: {built}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", [1, 5])
@pytest.mark.parametrize("n", [256, 768, 2048])
@pytest.mark.parametrize("k", [64, 640])
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("layout", ["x,x.mT", "r,r.mT", "s,s", "r,r.mT:k", "s,s:k"])
def test_cute_sym_gemm_pair(dtype, L: int, n: int, k: int, with_c: bool, layout: str, seed: int, monkeypatch) -> None:
    """The pair form (two CTAs of a cluster on a 256 x 256 tile, B multicast to both): exact
    symmetry, every element written, fp16/bf16 error within twice cuBLAS's against float64,
    on sides of 1, 3 and 8 pair tiles (a pair on the diagonal writes three of its four blocks)."""
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan.kernels import cute_symm

    if layout.startswith("s,s") and k != 640:
        pytest.skip("S @ S has k = n (or n - 64): one case per n")
    monkeypatch.setattr(cute_symm, "PAIR_MIN_N", 256)
    got, out, built = _cute_sym_gemm_checked(dtype, L, n, k, with_c, layout, seed, monkeypatch)
    assert got is out and [pair for pair, _ in built] == [True], f"the pair kernel did not run (seed {seed})"


def _cute_sym_gemm_checked(dtype, L: int, n: int, k: int, with_c: bool, layout: str, seed: int, monkeypatch) -> tuple:
    """cute_symm.sym_gemm on fresh random operands into a NaN-filled buffer; where it ran (it
    returns None outside its limits): every element written, exactly symmetric, error against
    float64 within twice cuBLAS's, the diagonal blocks mirrored exactly where the two operands
    are different memory ("r,r.mT") and left as computed where they are one matrix (X X^T,
    S S). ":k": each operand read only to a depth short of its memory (views whose strides
    exceed their extent, as Newton-Schulz reads a padded Gram side): X's first k of k + 64
    columns, S's first n - 64 rows and columns, still one matrix (no mirror). Returns (what it
    returned, the buffer, the (pair, mirror) of each kernel it ran)."""
    from dion3_titan.kernels import cute_symm

    built = []
    real = cute_symm._compiled
    monkeypatch.setattr(cute_symm, "_compiled", lambda *args: built.append(args[5:7]) or real(*args))
    depth = layout.endswith(":k")
    x = torch.randn(L, n, k + 64 if depth else k, device="cuda").to(dtype)
    # "r,r.mT": the first operand k-major, the second n-major (R @ R-style products);
    # "s,s": one symmetric n x n matrix on both sides (A A of Newton-Schulz)
    if layout.startswith("s,s"):
        x = _symmetric(L, n, dtype)
        a, b = (x[..., : n - 64], x[:, : n - 64]) if depth else (x, x)
    elif layout == "x,x.mT":
        a, b = x, x.mT
    else:
        a, b = x[..., :k], x.mT.contiguous()[:, :k]
    ref = torch.bmm(a.double(), b.double())
    c, alpha, beta = None, 1.0, 0.0
    theirs = torch.bmm(a, b)
    if with_c:
        alpha, beta = 0.75, -1.25
        c = _symmetric(L, n, dtype)
        ref = alpha * ref + beta * c.double()
        theirs = torch.baddbmm(c, a, b, alpha=alpha, beta=beta)
    out = torch.full((L, n, n), float("nan"), device="cuda", dtype=dtype)
    got = cute_symm.sym_gemm(a, b, c, alpha, beta, out=out)
    if got is None:
        return got, out, built
    assert got is out
    assert [mirror for _, mirror in built] == [layout.startswith("r,")], f"mirror chosen wrongly: {built}"
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"unwritten or non-finite output (seed {seed})"
    assert torch.equal(out, out.mT), f"result is not exactly symmetric (seed {seed})"
    assert _rel_err(out, ref) <= 2 * _rel_err(theirs, ref) + 1e-6, f"seed {seed}"
    return got, out, built


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(3, 256, 384, 512), (2, 2048, 2048, 1536), (1, 1024, 640, 3072), (2, 384, 256, 640), (2, 512, 256, 640)]
)
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("b_layout", ["rows", "transposed"])
def test_cute_gemm_general(dtype, shape: tuple, with_c: bool, b_layout: str, seed: int, monkeypatch) -> None:
    """The general mode (every tile, X <- a X + B X of standard NS): alpha A B + beta C into a
    NaN-filled buffer, every element written, error against float64 within twice cuBLAS's, in
    the pair form where n and m are multiples of 256 from PAIR_MIN_N on (forced from 256 here)
    and in 128 x 128 tiles where either is not (n = 384, m = 640)."""
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan.kernels import cute_symm

    monkeypatch.setattr(cute_symm, "PAIR_MIN_N", 256)
    built = []
    real = cute_symm._compiled
    monkeypatch.setattr(cute_symm, "_compiled", lambda *args: built.append(args[5:]) or real(*args))
    L, n, k, m = shape
    a = torch.randn(L, n, k, device="cuda").to(dtype)
    b = torch.randn(L, k, m, device="cuda").to(dtype)
    if b_layout == "transposed":
        b = b.mT.contiguous().mT
    c = torch.randn(L, n, m, device="cuda").to(dtype) if with_c else None
    alpha, beta = (0.75, -1.25) if with_c else (1.0, 0.0)
    ref = alpha * torch.bmm(a.double(), b.double())
    theirs = torch.bmm(a, b) if c is None else torch.baddbmm(c, a, b, alpha=alpha, beta=beta)
    if c is not None:
        ref = ref + beta * c.double()
    out = torch.full((L, n, m), float("nan"), device="cuda", dtype=dtype)
    got = cute_symm.gemm(a, b, c, alpha, beta, out=out)
    assert got is out
    pair = n % 256 == 0 and m % 256 == 0
    assert built == [(pair, False, True, False, False, False)], f"ran {built}"
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"unwritten or non-finite output (seed {seed})"
    assert _rel_err(out, ref) <= 2 * _rel_err(theirs, ref) + 1e-6, f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 256, 384, 512), (4, 2048, 2048, 1536), (4, 384, 256, 640)])
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("a_layout", ["rows", "transposed"])
def test_cute_gemm_flags_the_nonfinite_matrices(dtype, shape: tuple, with_c: bool, a_layout: str, seed: int) -> None:
    """The general mode with its finiteness check (``gemm``'s flags, Newton-Schulz's last
    product): exactly the matrices whose rounded result holds a NaN or inf are flagged (a NaN in
    C, an inf in A, a product beyond the dtype's range), a flag already set stays set, and the
    result has the bits of the unchecked kernel's."""
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan.kernels import cute_symm

    L, n, k, m = shape
    a, b, c = poisoned_operands(L, n, k, m, dtype)
    if a_layout == "transposed":
        a = a.mT.contiguous().mT
    c, beta = (c, 0.5) if with_c else (None, 0.0)
    assert_flags_the_poisoned(lambda flags: cute_symm.gemm(a, b, c, 1.0, beta, flags=flags), with_c, seed)


@pytest.mark.parametrize("shape", [(4, 512, 1536), (2, 1536, 512), (4, 256, 1024)], ids=["wide", "tall", "side256"])
def test_auto_picks_triton_for_gram_ns_in_the_optimizer(shape, seed: int, monkeypatch) -> None:
    """From a Gram side of 256 on, backend = "auto" orthogonalizes fp16 batches in Triton: one
    Dion3 step with "auto" runs its Gram NS on the Triton backend and moves the weights as the
    torch backend does, to fp16 rounding."""
    import dion3_titan.optim.dion3 as dion3_module
    from dion3_titan import Dion3
    from dion3_titan.kernels import select_backend

    chosen: list[str] = []

    def spy(*args):
        backend = select_backend(*args)
        chosen.append(backend.name)
        return backend

    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(*shape, generator=gen).cuda()
    grads = [torch.randn(*shape, generator=gen).cuda() for _ in range(2)]
    moved = {}
    for backend in ("auto", "torch"):
        if backend == "auto":
            monkeypatch.setattr(dion3_module, "select_backend", spy)
        w = torch.nn.Parameter(w0.clone())
        opt = Dion3(
            [w], lr=0.02, fraction=1.0, ns_dtype="float16", ns_algorithm="gram", backend=backend, weight_decay=0.0
        )
        for g in grads:
            w.grad = g.clone()
            opt.step()
        monkeypatch.undo()
        moved[backend] = (w.detach() - w0).double()
    assert chosen and set(chosen) == {"triton"}, chosen
    assert _rel_err(moved["auto"], moved["torch"]) < 1e-2


def test_persistent_kernels_replay_from_a_cuda_graph(seed: int) -> None:
    """The persistent kernels build their TMA descriptors on the device in scratch memory that
    Triton allocates at launch: captured in a CUDA graph (square and wide tiles, with C, and the
    TMA GEMM), each replay on fresh inputs matches float64, with eager work allocating and
    freeing memory between the replays."""
    from dion3_titan.kernels import triton_mm, triton_ops

    L, n, k = 2, 384, 256
    x = torch.randn(L, n, k, device="cuda").half()
    r = _symmetric(L, n, torch.float16) / n**0.5
    outs = [torch.empty(L, n, n, device="cuda", dtype=torch.float16) for _ in range(4)]

    def run() -> None:
        assert triton_ops.sym_gemm_tma(x, x.mT, config=(128, 64, 8, 8, 4), out=outs[0]) is outs[0]
        assert triton_ops.sym_gemm_tma(x, x.mT, config=(128, 64, 8, 8, 3, False, True), out=outs[1]) is outs[1]
        assert (
            triton_ops.sym_gemm_tma(r, r, r, 0.5, 1.5, config=(128, 64, 8, 8, 3, False, True), out=outs[2]) is outs[2]
        )
        cfg = triton_mm.Config(128, 128, 64, 8, 8, 3)
        assert triton_mm.mm_tma(r, r, r, 1.0, 1.875, config=cfg, out=outs[3]) is outs[3]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiles: not capturable
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        r.copy_(_symmetric(L, n, torch.float16) / n**0.5)
        junk = [torch.full((1 << 16,), 7, device="cuda", dtype=torch.int8) for _ in range(8)]
        del junk
        graph.replay()
        torch.cuda.synchronize()
        xd, rd = x.double(), r.double()
        refs = [xd @ xd.mT, xd @ xd.mT, 0.5 * (rd @ rd) + 1.5 * rd, rd @ rd + 1.875 * rd]
        for i, (out, ref) in enumerate(zip(outs, refs)):
            err = _rel_err(out, ref)
            assert err < 2e-3, f"output {i}: relative error {err} (seed {seed})"
        assert all(torch.equal(o, o.mT) for o in outs[:3])


@pytest.mark.parametrize(
    "shape",
    [(1024, 1024), (2048, 2048), (4096, 4096), (2752, 4096)],
    ids=["tiles1024", "pairs2048", "pairs4096", "gram2752"],
)
def test_auto_runs_cutedsl_in_a_captured_step_where_the_table_sends_it(shape: tuple, seed: int, monkeypatch) -> None:
    """backend = "auto" on Hopper: a batch whose shape the measured table sends to CuteDSL
    (dispatch.prefers_cute: 128 x 128 tiles at 1024, pair tiles from 2048 on) is orthogonalized
    by the CuteDSL kernels inside the captured step, in the form the table names, its
    X <- a X + B X (or Gram NS's last Q X) in the general mode (cute_symm.GENERAL), the last
    one checking its result for the Muon flavor (no pass of row sums). 2752 rows (7B's w1/w3 at
    f = 1/4) run at the Gram side 2816, packed there by the step, and the products over it read
    only the first 2752 rows (cute_symm.SKIP_PADDING). The capture calls them (the replays
    call nothing on the host), and the replayed steps move the weights exactly as eager steps
    with backend = "cute" do."""
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan import Dion3
    from dion3_titan.kernels import cute_symm, dispatch
    from dion3_titan.optim import engine
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    # fraction 1: one batch, standard NS where square, Gram NS at 2752 x 4096
    side = dispatch.get_backend("triton").gram_side(shape[0])
    assert dispatch.prefers_cute(side), "the table no longer sends this shape to CuteDSL"
    # what the symmetric products read along their inner dimension: X X^T the columns, the
    # others the side to its depth (2752 of 2816 at 2752 rows; the whole side where square)
    depths = {shape[1], dispatch.get_backend("cute").gram_depth(shape[0])}
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(*shape, generator=gen).cuda()
    grads = [torch.randn(*shape, generator=gen).cuda() for _ in range(6)]
    calls = {"cute": 0, "general": 0, "checked": 0, "row_sums": 0}
    forms: set[bool] = set()  # the pair flag of every kernel the capture built or looked up
    real, real_gemm, real_compiled = cute_symm.sym_gemm, cute_symm.gemm, cute_symm._compiled
    read: set[int] = set()  # the inner dimension of every symmetric product

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["cute"] += out is not None
        read.add(args[0].shape[-1])
        return out

    def gemm_spy(*args, **kwargs):
        out = real_gemm(*args, **kwargs)
        calls["general"] += out is not None
        calls["checked"] += out is not None and kwargs.get("flags") is not None
        return out

    real_sums = engine.row_sumsq

    def sums_spy(x):
        calls["row_sums"] += 1
        return real_sums(x)

    def compiled_spy(*args):
        forms.add(args[5])
        return real_compiled(*args)

    moved = {}
    for backend, graphed in (("auto", True), ("cute", False)):
        w = torch.nn.Parameter(w0.clone())
        opt = Dion3([w], lr=0.02, fraction=1.0, ns_algorithm="auto", backend=backend, weight_decay=0.0)
        runner = GraphedOptimizer(opt, warmup_steps=3) if graphed else opt
        for i, g in enumerate(grads):
            if graphed and i == 3:
                monkeypatch.setattr(cute_symm, "sym_gemm", spy)  # the capturing step
                monkeypatch.setattr(cute_symm, "gemm", gemm_spy)
                monkeypatch.setattr(cute_symm, "_compiled", compiled_spy)
                monkeypatch.setattr(engine, "row_sumsq", sums_spy)
            if graphed and i == 4:
                captured = dict(calls)
            w.grad = g.clone()
            runner.step()
        monkeypatch.undo()
        if graphed:
            assert runner.graph is not None, "the step was not captured"
            assert captured["cute"] > 0, "the captured step ran no CuteDSL kernel"
            assert captured["general"] > 0 or not cute_symm.GENERAL, "X <- a X + B X did not run in CuteDSL"
            # the Muon flavor's NS check comes from the last product's epilogue, not a pass
            assert captured["checked"] == 1 and captured["row_sums"] == 0 or not cute_symm.GENERAL, captured
            assert calls == captured, "replays called kernels from the host"
            assert forms == {cute_symm.pairs(side)}, f"pair form {forms} at side {side}"
            assert read == depths, f"products read {read}, expected {depths}"
        torch.cuda.synchronize()
        moved[backend] = w.detach().clone()
    assert torch.equal(moved["auto"], moved["cute"]), f"replayed steps differ from eager CuteDSL steps (seed {seed})"


@pytest.mark.parametrize(
    "shape", [(3, 2752, 3072), (2, 3072, 2752), (2, 1344, 1344)], ids=["wide_pairs", "tall_pairs", "square_tiles"]
)
def test_cute_ns_reads_a_padded_side_to_its_depth(shape: tuple, seed: int, monkeypatch) -> None:
    """CuteDSL's Newton-Schulz at a padded Gram side (2752 -> 2816 in pair tiles, Gram NS wide
    and tall; 1344 -> 1408 in 128 x 128 tiles, standard NS) with the products over the side
    read to its depth (cute_symm.SKIP_PADDING: 2752, 1344) against the same reading the whole
    side: the products read what they should, and the results agree to fp16 rounding and are
    as close to the float64 reference."""
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan.kernels import cute_symm
    from dion3_titan.kernels.dispatch import get_backend
    from dion3_titan.kernels.torch_ops import TorchOps
    from dion3_titan.optim.config import coefficient_schedule
    from dion3_titan.optim.orthogonalize import NSSettings, orthogonalize

    coeffs = coefficient_schedule("polar_express", 5, 1.05)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", generator=gen)
    want = orthogonalize(x.double(), NSSettings("auto", coeffs, (2,), torch.float64), TorchOps())
    settings, ops = NSSettings("auto", coeffs, (2,), torch.float16), get_backend("cute")
    n, m = sorted(shape[1:])
    side, depth = ops.gram_side(n), -(-n // 64) * 64
    read: list[int] = []
    real = cute_symm.sym_gemm
    monkeypatch.setattr(cute_symm, "sym_gemm", lambda a, *args, **kw: read.append(a.shape[-1]) or real(a, *args, **kw))
    skipping = orthogonalize(x, settings, ops)
    assert set(read) == {m, depth}, f"read {sorted(set(read))}"
    read.clear()
    monkeypatch.setattr(cute_symm, "SKIP_PADDING", False)
    whole = orthogonalize(x, settings, ops)
    assert set(read) == {m, side}, f"read {sorted(set(read))}"
    torch.cuda.synchronize()
    assert skipping.shape == whole.shape == x.shape
    err_skipping, err_whole = _rel_err(skipping, want), _rel_err(whole, want)
    assert _rel_err(skipping, whole.double()) < 1e-2, f"seed {seed}"
    assert err_skipping <= 1.25 * err_whole + 1e-3, f"{err_skipping} vs {err_whole} (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("side", [2816, 1408], ids=["pairs", "tiles"])
@pytest.mark.parametrize("zero", [64, 128, 192])
@pytest.mark.parametrize("layout", ["x,x.mT", "r,r.mT+c", "s,s:k+c"])
def test_cute_sym_gemm_skips_zero_rows(dtype, side: int, zero: int, layout: str, seed: int, monkeypatch) -> None:
    """A symmetric product told that A's last ``zero`` rows are zero (``zero_from``, the padding
    of a Gram side) leaves out the products of the consumer warpgroups whose 64 rows lie there
    (cute_symm.SKIP_ZERO_ROWS: a warpgroup's, a CTA's, or one and a half CTAs' rows): the result
    is bit for bit the one that multiplies the zeros, with C and without, mirrored and not, in
    pair tiles and in 128 x 128 tiles, with the kernel that skips built; and that kernel given a
    bound no warpgroup reaches (SKIP_NEVER, the benchmark's control) gives it too."""
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan.kernels import cute_symm

    if side % 256 != 0:
        monkeypatch.setattr(cute_symm, "PAIR_MIN_N", 1 << 30)
    built = []
    real = cute_symm._compiled
    monkeypatch.setattr(cute_symm, "_compiled", lambda *args: built.append(args) or real(*args))
    L, k, real_rows = 3, 640, side - zero
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if layout.startswith("s,s"):  # A A over the side read to the real rows, as Newton-Schulz's R R
        s = torch.randn(L, side, side, device="cuda", generator=gen)
        s = ((s + s.mT) / 2).to(dtype)
        s[:, real_rows:], s[:, :, real_rows:] = 0, 0
        a, b = s[..., :real_rows], s[:, :real_rows]
    else:
        x = torch.randn(L, side, k, device="cuda", generator=gen).to(dtype)
        x[:, real_rows:] = 0
        a, b = (x, x.mT) if layout == "x,x.mT" else (x, x.mT.contiguous())
    c = _symmetric(L, side, dtype) if layout.endswith("+c") else None
    alpha, beta = (0.75, -1.25) if c is not None else (1.0, 0.0)
    results = {}
    for name, switches in {
        "multiplied": {"SKIP_ZERO_ROWS": False},
        "skipped": {},
        "never_taken": {"SKIP_NEVER": True},
    }.items():
        with monkeypatch.context() as m:
            for key, value in switches.items():
                m.setattr(cute_symm, key, value)
            built.clear()
            out = torch.full((L, side, side), float("nan"), device="cuda", dtype=dtype)
            assert cute_symm.sym_gemm(a, b, c, alpha, beta, out=out, zero_from=real_rows) is out
            assert [args[-1] for args in built] == [name != "multiplied"], f"{name}: kernels built {built}"
            results[name] = out
    torch.cuda.synchronize()
    assert torch.isfinite(results["multiplied"]).all(), f"seed {seed}"
    for name in ("skipped", "never_taken"):
        assert torch.equal(results[name], results["multiplied"]), f"{name} differs (seed {seed})"


@pytest.mark.parametrize(
    "shape", [(3, 2752, 3072), (2, 3072, 2752), (2, 1344, 1344)], ids=["wide_pairs", "tall_pairs", "square_tiles"]
)
def test_cute_ns_skips_the_padding_rows_products(shape: tuple, seed: int, monkeypatch) -> None:
    """CuteDSL's Newton-Schulz at a padded Gram side names the padding to its symmetric products
    (``zero_from``: every one's A is zero from the depth on) and they leave out the warpgroups
    there: the result is bit for bit the one that multiplies the zeros (cute_symm.SKIP_ZERO_ROWS
    off), in pair tiles (2752 -> 2816, Gram NS wide and tall) and 128 x 128 tiles (1344 -> 1408,
    standard NS)."""
    if not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan.kernels import cute_symm
    from dion3_titan.kernels.dispatch import get_backend
    from dion3_titan.optim.config import coefficient_schedule
    from dion3_titan.optim.orthogonalize import NSSettings, orthogonalize

    coeffs = coefficient_schedule("polar_express", 5, 1.05)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", generator=gen)
    settings, ops = NSSettings("auto", coeffs, (2,), torch.float16), get_backend("cute")
    skips = []
    real = cute_symm._compiled
    monkeypatch.setattr(cute_symm, "_compiled", lambda *args: skips.append(args[-1]) or real(*args))
    skipping = orthogonalize(x, settings, ops)
    assert True in skips, "no product skipped the padding rows"
    monkeypatch.setattr(cute_symm, "SKIP_ZERO_ROWS", False)
    skips.clear()
    multiplied = orthogonalize(x, settings, ops)
    assert True not in skips
    torch.cuda.synchronize()
    assert torch.isfinite(multiplied).all()
    assert torch.equal(skipping, multiplied), f"seed {seed}"


@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize(
    "shape", [(6, 2048, 2048), (5, 512, 1536), (5, 1536, 384)], ids=["square_pairs", "wide_gram", "tall_gram"]
)
def test_halves_on_two_streams_match_one_batch(backend: str, shape: tuple, seed: int, monkeypatch) -> None:
    """Newton-Schulz in halves on two side streams (orthogonalize.in_halves) gives the one-batch
    result bit for bit, in its memory order, with the last product's flags of both halves joined
    (a matrix of the second half made non-finite), eagerly and replayed from a CUDA graph on
    fresh inputs (the streams fork from and join the capturing stream)."""
    if backend == "cute" and not _cute_ready():
        pytest.skip("CuteDSL or an SM90 GPU missing")
    from dion3_titan.kernels.dispatch import get_backend
    from dion3_titan.optim import orthogonalize as om
    from dion3_titan.optim.config import coefficient_schedule

    settings = om.NSSettings("auto", coefficient_schedule("polar_express", 5, 1.05), (2,), torch.float16)
    ops = get_backend(backend)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def batch() -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
        x[-1, 1, 2] = float("inf")
        return x

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        check = om.ResultCheck()
        return om.orthogonalize(x, settings, ops, check=check), check.bad

    x = batch()
    whole, whole_bad = run(x)
    monkeypatch.setattr(om, "HALVES_MIN_FLOPS", 0)
    wide = x.mT if shape[1] > shape[2] else x
    assert om.runs_in_halves(wide), "the threshold at 0 should split every batch of two or more"
    halves, bad = run(x)
    torch.cuda.synchronize()
    torch.testing.assert_close(halves, whole, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")
    assert halves.stride() == whole.stride()
    assert (bad is None) == (whole_bad is None)
    if bad is not None:
        assert bad.tolist() == whole_bad.tolist() == [False] * (shape[0] - 1) + [True], f"seed {seed}"

    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(static)  # warm: nothing compiles in the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_bad = run(static)
    for _ in range(2):
        fresh = batch()
        static.copy_(fresh)
        graph.replay()
        eager, eager_bad = run(fresh)
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")
        if eager_bad is not None:
            assert captured_bad.tolist() == eager_bad.tolist(), f"seed {seed}"
