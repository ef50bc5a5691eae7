"""Launching the project's Triton kernels at a fraction of the JIT's host cost.

``kernel[grid](*args, **meta)`` spends ~20 µs of host time per launch on a fast host (more on a
slow one) before the driver call: Triton re-reads its knobs, binds and specializes every
argument, builds a cache key string and looks the compiled kernel up. An eager optimizer step
makes ~100 such launches (docs/benchmarks.md, "Eager host time"). ``launch`` keys the compiled
kernel by the launch's arguments and calls it directly:

- a tensor by its dtype and whether its address is a multiple of 16 bytes (what Triton
  specializes on), a tensor descriptor by its dtype and block shape (likewise), a float by its
  type (Triton passes every float as fp32);
- an integer, a bool or None by its value: finer than Triton's specialization (integers equal
  to 1, multiples of 16, 32 or 64 bit), so two launches of one key always get the same
  compiled kernel. Our integer arguments are sizes and strides, the same every step;
- the constexpr values and launch options (``meta``), the grid, and the current device (where
  the JIT launches too), as given.

A launch whose key is new goes through the JIT (which compiles on first use) and its compiled
kernel is kept. Under Triton's interpreter, with launch hooks set (a profiler), with an argument
the key cannot hold, or with ``DION3_LAUNCH_CACHE=0``, every launch takes the JIT's path.
``VERIFY`` (the tests set it) checks on every cached launch that the JIT would have chosen the
same compiled kernel.

Runtime arguments are passed positionally and constexprs by keyword, as at every call site
here; the compiled kernel takes all of them in signature order.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from dion3_titan.kernels.backend import interpreting

VERIFY = os.environ.get("DION3_VERIFY_LAUNCHES", "0") == "1"
# DION3_LAUNCH_CACHE=0 sends every launch through the JIT (to rule the cache out, or to time it)
ENABLED = os.environ.get("DION3_LAUNCH_CACHE", "1") != "0"
CAPACITY = 1024  # compiled-kernel entries kept (a step uses ~30 distinct ones)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's grid and block arithmetic (``triton.cdiv`` is a constexpr
    function: ~3 µs of host time per call, a few per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0, as ``triton.next_power_of_2``), on the host."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class Unkeyed(Exception):
    """An argument the key cannot hold: the launch takes the JIT's path."""


def key_of(kernel, grid: tuple, args: Sequence, meta: dict, device: int = 0) -> tuple:
    """The cache key of a launch on CUDA device ``device`` (module docstring; a compiled kernel
    is loaded per device); raises Unkeyed for an argument it cannot hold."""
    spec = []
    for a in args:  # one plain loop: this runs for every launch of a step
        kind = a.__class__
        if kind is int or a is None:
            spec.append(a)
        elif kind is bool:  # True == 1 as a key, but Triton passes a bool as u1
            spec.append((bool, a))
        elif kind is float:
            spec.append(float)
        elif kind is torch.Tensor or isinstance(a, torch.Tensor):
            spec.append((a.dtype, a.data_ptr() & 15 == 0))
        elif kind is TensorDescriptor:
            spec.append((a.base.dtype, tuple(a.block_shape)))
        else:
            raise Unkeyed(kind)
    return (id(kernel), device, grid, tuple(meta.items()), tuple(spec))


@dataclass(frozen=True)
class _Entry:
    run: object  # the compiled kernel's launcher for this grid
    compiled: object  # what the JIT returned (VERIFY compares against it)
    tail: tuple  # the constexpr arguments after the positional ones, in signature order


_ENTRIES: OrderedDict[tuple, _Entry] = OrderedDict()
stats = {"hits": 0, "misses": 0, "jit": 0}


def _tail(kernel, n_args: int, meta: dict) -> tuple | None:
    """Values of the signature's parameters after the first ``n_args``, from ``meta`` or their
    defaults; None if one of them is a runtime argument (passed by keyword: not cached)."""
    out = []
    for p in kernel.params[n_args:]:
        if not p.is_constexpr:
            return None
        out.append(meta[p.name] if p.name in meta else p.default)
    return tuple(out)


def _hooked(hook: object) -> bool:
    """Whether a launch hook is set: a function, or a hook chain (newer Triton) with calls."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _may_cache() -> bool:
    """Whether a launch may take the cache now: switched on, compiled kernels, no launch hooks."""
    runtime = knobs.runtime
    return (
        ENABLED and not interpreting() and not (_hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook))
    )


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, through the cache of compiled kernels where it applies."""
    if _counts is not None:
        _counts[kernel.__name__] += 1
    key = entry = None
    if _may_cache():
        try:
            key = key_of(kernel, grid, args, meta, torch.cuda.current_device())
            entry = _ENTRIES.get(key)
        except (Unkeyed, TypeError):  # TypeError: a meta value that cannot be hashed
            key = None
    if key is None:
        stats["jit"] += 1
        kernel[grid](*args, **meta)
        return
    if entry is None:
        stats["misses"] += 1
        compiled = kernel[grid](*args, **meta)
        tail = _tail(kernel, len(args), meta)
        if compiled is not None and tail is not None:
            _ENTRIES[key] = _Entry(compiled[tuple(grid) + (1,) * (3 - len(grid))], compiled, tail)
            while len(_ENTRIES) > CAPACITY:
                _ENTRIES.popitem(last=False)
        return
    stats["hits"] += 1
    if VERIFY:
        chosen = kernel.run(*args, grid=grid, warmup=True, **meta)
        if chosen is not entry.compiled:
            raise AssertionError(f"launch cache: {kernel.__name__} took another compiled kernel than the JIT's")
    entry.run(*args, *entry.tail)


_counts: Counter | None = None


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count the launches made inside the block by kernel name, whichever path each takes."""
    global _counts
    outer, _counts = _counts, Counter()
    try:
        yield _counts
    finally:
        _counts = outer


def clear() -> None:
    """Forget every compiled-kernel entry (tests)."""
    _ENTRIES.clear()
    for k in stats:
        stats[k] = 0
