"""What the persistent TMA kernels (triton_ops.py, triton_mm.py) share: how a batched operand
is described to the copy engine, one k-step of their product, the grid size, and the one-time
fallback when a Triton version cannot build a kernel."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (persistent kernels launch one program per
    SM); 4 for a CPU tensor under the interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_stacked(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(L, r, c) -> a 2D view with unit last stride that stacks the batch along rows: (L*r, c)
    of t itself (False) or (L*c, r) of its transpose (True); None when t is neither. A tile of
    such a view never straddles two matrices when its rows divide r (or c)."""
    L, r, c = t.shape
    if t.is_contiguous():
        return t.view(L * r, c), False
    if t.mT.is_contiguous():
        return t.mT.reshape(L * c, r), True
    return None


@triton.jit
def mma_step(
    acc,
    a_desc,
    b_desc,
    batch,
    ti,
    tj,
    kk,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc + (k-slice kk of A's tile row ti) @ (k-slice kk of B's tile column tj) for matrix
    ``batch`` of (L, M, K) @ (L, K, N), both operands from ``rows_stacked`` views: ``A_T``/``B_T``
    say the descriptor holds the operand's transpose, whose tile is loaded and transposed."""
    if A_T:
        a = a_desc.load([batch * K + kk * BLOCK_K, ti * BLOCK_M]).T
    else:
        a = a_desc.load([batch * M + ti * BLOCK_M, kk * BLOCK_K])
    if B_T:
        b = b_desc.load([batch * N + tj * BLOCK_N, kk * BLOCK_K]).T
    else:
        b = b_desc.load([batch * K + kk * BLOCK_K, tj * BLOCK_N])
    if INTERPRET:  # the interpreter's bf16 dot multiplies the raw bits; fp32 products of the
        # exactly upcast inputs give the same fp32-accumulated result
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


def operand_descriptors(
    sa: tuple[torch.Tensor, bool], sb: tuple[torch.Tensor, bool], block_m: int, block_n: int, block_k: int
) -> tuple:
    """The TMA descriptors ``mma_step`` reads A and B through, from their ``rows_stacked``
    views: (a_desc, b_desc, A_T, B_T), with (block_m, block_k) tiles of A and (block_k, block_n)
    tiles of B, held transposed where the view is the transpose."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (a2, a_t), (b2, b_t) = sa, sb
    a_desc = TensorDescriptor.from_tensor(a2, [block_k, block_m] if a_t else [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(b2, [block_n, block_k] if b_t else [block_k, block_n])
    return a_desc, b_desc, a_t, b_t


def aligned(*tensors: torch.Tensor | None) -> bool:
    """TMA's rule for the base address: 16 bytes (None entries are skipped)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors if t is not None)


_BROKEN: dict[str, str] = {}  # kernel name -> why this Triton could not build or run it


def launch_or_none(name: str, launch: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    """``launch()``, or None once it has failed (a Triton that cannot build kernel ``name``):
    the caller then computes the same with its general path. Warns once per kernel; inside a
    CUDA-graph capture the error is raised, since a failed capture cannot fall back."""
    if name in _BROKEN:
        return None
    try:
        return launch()
    except Exception as e:
        if torch.cuda.is_current_stream_capturing():
            raise
        _BROKEN[name] = f"{type(e).__name__}: {str(e)[:200]}"
        warnings.warn(
            f"dion3_titan: persistent TMA kernel {name} unavailable ({_BROKEN[name]}); using the general path",
            stacklevel=3,
        )
        return None
