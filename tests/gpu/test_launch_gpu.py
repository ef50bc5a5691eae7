"""kernels/launch.py on a GPU: a cached launch computes what the JIT's launch computes, for
every specialization the key tells apart, inside a CUDA graph too; the JIT's path where the
cache does not apply. ``DION3_VERIFY_LAUNCHES`` (tests/conftest.py) checks every hit here and
in the rest of the GPU suite against the JIT's own choice of compiled kernel."""

import pytest
import torch
from triton import knobs

from dion3_titan.kernels import launch, triton_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, beta: float) -> torch.Tensor:
    out = alpha * (a.double() @ b.double())
    return out if c is None else out + beta * c.double()


def _operand(L: int, n: int, k: int, shift: int) -> torch.Tensor:
    """(L, n, k) fp16 whose storage starts ``shift`` elements into its buffer (shift 1: an
    address that is not a multiple of 16 bytes)."""
    flat = torch.randn(L * n * k + shift, device="cuda").half()
    return flat[shift:].view(L, n, k)


@pytest.mark.parametrize("n,k", [(96, 80), (128, 64), (33, 1), (1, 16)])
@pytest.mark.parametrize("shift", [0, 1])
def test_cached_launches_compute_what_the_jit_does(n: int, k: int, shift: int, seed: int) -> None:
    assert launch.VERIFY, "the GPU tests run with DION3_VERIFY_LAUNCHES=1"
    launch.clear()
    for step in range(3):  # a miss (JIT, compiles), then hits (cached, verified)
        a = _operand(2, n, k, shift)
        c = torch.randn(2, n, n, device="cuda").half()
        c = (c + c.mT) / 2
        alpha, beta = 0.5 + step, -0.25 * (step + 1)  # floats: one entry serves every value (beta 0 drops C)
        out = triton_ops.sym_gemm(a, a.mT, c, alpha, beta, config=triton_ops.SYM_CONFIG)
        ref = _reference(a, a.mT, c, alpha, beta)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, f"step {step}: relative error {err} (seed {seed})"
        assert torch.equal(out, out.mT)
    assert launch.stats["misses"] == 1 and launch.stats["hits"] == 2, launch.stats


def test_the_key_tells_apart_what_triton_specializes(seed: int) -> None:
    launch.clear()
    aligned = _operand(1, 64, 64, 0)
    shifted = _operand(1, 64, 64, 1)
    for a in (aligned, shifted, aligned, shifted):
        out = triton_ops.sym_gemm(a, a.mT, config=triton_ops.SYM_CONFIG)
        ref = _reference(a, a.mT, None, 1.0, 0.0)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    # two compiled variants (16-byte aligned or not), each launched twice
    assert launch.stats["misses"] == 2 and launch.stats["hits"] == 2, launch.stats


def test_a_launch_hook_takes_the_jit_path(seed: int) -> None:
    launch.clear()
    a = _operand(1, 64, 64, 0)
    triton_ops.sym_gemm(a, a.mT, config=triton_ops.SYM_CONFIG)
    calls = []
    knobs.runtime.launch_enter_hook = lambda metadata: calls.append(metadata)
    try:
        out = triton_ops.sym_gemm(a, a.mT, config=triton_ops.SYM_CONFIG)
    finally:
        knobs.runtime.launch_enter_hook = None
    assert calls and launch.stats["jit"] == 1 and launch.stats["hits"] == 0, launch.stats
    ref = _reference(a, a.mT, None, 1.0, 0.0)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_a_captured_graph_replays_a_cached_launch(seed: int) -> None:
    launch.clear()
    a = _operand(3, 256, 512, 0)
    out = torch.empty(3, 256, 256, dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_ops.sym_gemm(a, a.mT, out=out, config=triton_ops.SYM_CONFIG)  # compiles: not capturable
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_ops.sym_gemm(a, a.mT, out=out, config=triton_ops.SYM_CONFIG)
    assert launch.stats["hits"] >= 1, launch.stats
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(a, a.mT, None, 1.0, 0.0)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
