"""What the persistent TMA kernels (triton_ops.py, triton_mm.py) share: how a batched operand
is described to the copy engine (descriptors built on the device), one k-step of their product,
the grid size, and the one-time fallback when a Triton version cannot build a kernel."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Hashable, Iterator

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


_LEFT_FREE = contextvars.ContextVar("dion3_sms_left_free", default=0)


def grid_sms(device: torch.device) -> int:
    """The programs (CTAs) of a persistent kernel launched now: one per SM, less the SMs that
    ``leave_sms`` keeps free for kernels running beside it on another stream."""
    return max(1, num_sms(device) - _LEFT_FREE.get())


@contextlib.contextmanager
def leave_sms(count: int) -> Iterator[None]:
    """Persistent kernels launched inside leave ``count`` SMs free. Which tile a program runs
    changes, not how a tile is computed: results are bit-identical."""
    token = _LEFT_FREE.set(count)
    try:
        yield
    finally:
        _LEFT_FREE.reset(token)


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


@triton.jit
def stacked_desc(ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The TMA descriptor of a ``rows_stacked`` view (rows, cols) with unit last stride, built
    on the device by the kernel itself: a host-built descriptor costs ~5-8 µs of host time per
    operand and launch (Triton encodes it at every launch), one built here costs a 128-byte
    scratch slot per program (``ensure_scratch_allocator``)."""
    return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[cols, 1], block_shape=[BLOCK_R, BLOCK_C])


@triton.jit
def operand_descs(
    a_ptr,
    b_ptr,
    M,
    N,
    K,
    L,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
):
    """The descriptors ``mma_step`` reads (L, M, K) @ (L, K, N) through, from the base pointers
    of the operands' ``rows_stacked`` views: (block_m, block_k) tiles of A and (block_k, block_n)
    tiles of B, held transposed where ``A_T``/``B_T`` say the view is the transpose."""
    if A_T:
        a_desc = stacked_desc(a_ptr, L * K, M, BLOCK_K, BLOCK_M)
    else:
        a_desc = stacked_desc(a_ptr, L * M, K, BLOCK_M, BLOCK_K)
    if B_T:
        b_desc = stacked_desc(b_ptr, L * N, K, BLOCK_N, BLOCK_K)
    else:
        b_desc = stacked_desc(b_ptr, L * K, N, BLOCK_K, BLOCK_N)
    return a_desc, b_desc


def torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's launch-time scratch from torch's caching allocator on the current device and
    stream (its blocks are 512-byte aligned, more than a descriptor's 128): stream-ordered, so
    a CUDA graph captures it like any other allocation."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator for the kernels' device-side descriptors unless the program has
    set its own (Triton has none by default and refuses such a launch)."""
    from triton.runtime import _allocation

    current = _allocation._allocator.get()
    if current is None or isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(torch_scratch)


def aligned(*tensors: torch.Tensor | None) -> bool:
    """TMA's rule for the base address: 16 bytes (None entries are skipped)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors if t is not None)


_BROKEN: dict[Hashable, str] = {}  # kernel variant -> why this Triton could not build or run it


def launch_or_none(name: Hashable, launch: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    """``launch()``, or None once it has failed (a Triton that cannot build kernel variant
    ``name``, any hashable that names it: built per call, so cheap to hash):
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
