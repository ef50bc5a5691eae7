"""The host Python of an eager Dion3 step, measured without a GPU: the part of the eager step's
host time (benchmarks/host_profile.py on a GPU) that is ours rather than the launches'.

The row engine serves the matrices as on a GPU (Triton's interpreter, set here before Triton is
imported, lets it take CPU tensors), but its kernel launches do nothing and Newton-Schulz hands
back a zero batch of the right shape: what is timed is the stages' Python and their torch ops
on CPU tensors (each cheaper on the host than a CUDA op), per step and per stage. The shapes are
a model's (``--model``, default 7b) divided by ``--shrink``, the same shape groups and members
at any divisor, so the Python is the same and the CPU work small. A GPU host measured 2-3x these
stage times (docs/benchmarks.md, "Eager host time"); read this as a comparison between two
versions of the code on one machine, interleaved or back to back.

    python scripts/profile_host_python.py --fraction 0.25 --flavor normuon --layers 8

``--part ns`` times Newton-Schulz's host Python instead, which the step above stubs out: each
of the model's Newton-Schulz batches at its full widths (one matrix per batch: the Python does
not depend on the batch size), through the backend "auto" picks for it on a Hopper GPU (or the
one named), with every kernel call stubbed: CuteDSL's compiled kernel, Triton's launches and
cuBLAS's products (handed back as empty tensors). What remains is our dispatch Python around
each product and the torch ops between them, on CPU tensors.

    python scripts/profile_host_python.py --part ns --fraction 0.25
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (below, through dion3_titan)

import torch  # noqa: E402

from benchmarks.host_profile import timed_stages  # noqa: E402
from benchmarks.llama import MODELS, GradFiller, ModelShape, build_model, layer_matrices  # noqa: E402
from dion3_titan import Dion3  # noqa: E402
from dion3_titan.dist.plan import rows_to_select  # noqa: E402
from dion3_titan.kernels import cute_symm, dispatch, row_engine, triton_mm, triton_ops  # noqa: E402
from dion3_titan.kernels.backend import Backend  # noqa: E402
from dion3_titan.kernels.torch_ops import TorchOps  # noqa: E402
from dion3_titan.optim.config import Dion3Config  # noqa: E402
from dion3_titan.optim.orthogonalize import NSSettings, ResultCheck, orthogonalize  # noqa: E402
from dion3_titan.optim.routing import build_param_groups  # noqa: E402


class _ZeroNS(Dion3):
    """Dion3 whose Newton-Schulz hands back zeros (one buffer per shape, kept), with no flags
    from its last product (so the stages' result check runs as where the backend has none)."""

    def __init__(self, *args, **kwargs) -> None:
        self._zero_batches: dict[tuple, torch.Tensor] = {}
        super().__init__(*args, **kwargs)

    def _orthogonalize(self, g, owned, backend, tall, normalized, rows):  # noqa: ANN001, ANN202 (Dion3's signature)
        shape = owned[:, :rows].shape  # the real rows of a batch packed at the Gram side
        key = (tuple(shape), g.ns.dtype)
        if key not in self._zero_batches:
            self._zero_batches[key] = torch.zeros(shape, dtype=g.ns.dtype)
        return self._zero_batches[key], None


@contextlib.contextmanager
def launches_stubbed() -> Iterator[None]:
    """The row engine's kernel launches do nothing inside the block."""
    passes = (row_engine.accumulate, row_engine.gather, row_engine.normuon, row_engine.update)
    real = [module.launch for module in passes]
    for module in passes:
        module.launch = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for module, launch in zip(passes, real):
            module.launch = launch


@contextlib.contextmanager
def products_stubbed() -> Iterator[None]:
    """Every Newton-Schulz product does nothing inside the block: CuteDSL's compiled kernel (and
    its compilation), Triton's launches, cuBLAS's products (an empty result of the right shape)."""
    saved = [
        (cute_symm, "_compiled", lambda *key: lambda *args: None),
        (cute_symm, "is_available", lambda: True),
        (triton_ops, "launch", lambda *args, **kwargs: None),
        (triton_mm, "launch", lambda *args, **kwargs: None),
        (
            TorchOps,
            "mm",
            lambda self, a, b, out=None: a.new_empty((a.shape[0], a.shape[1], b.shape[2])) if out is None else out,
        ),
    ]
    saved = [(owner, name, getattr(owner, name), stub) for owner, name, stub in saved]
    for owner, name, _, stub in saved:
        setattr(owner, name, stub)
    try:
        yield
    finally:
        for owner, name, real, _ in saved:
            setattr(owner, name, real)


def _keep_freed_memory() -> None:
    """glibc hands large blocks back to the system when freed, so every fresh n x n buffer would
    page-fault where the step writes its diagonal; a GPU's caching allocator reuses its blocks.
    Keep freed memory in the heap, as that allocator would (this process only)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


def ns_batches(
    shape: ModelShape, fraction: float, preference: str
) -> list[tuple[torch.Tensor, bool, Backend, int | None]]:
    """(x, tall, backend, rows) of each distinct layer matrix shape's Newton-Schulz at
    ``fraction`` (its selected rows x its columns), x one fp16 matrix packed at the backend's
    Gram side, as the step hands it over normalized (with its real rows where wide). ``preference`` "auto": the backend "auto" picks on a Hopper
    GPU with CuteDSL (``dispatch.auto_choice``)."""
    out = []
    for rows, cols in dict.fromkeys(layer_matrices(shape)):
        k = rows_to_select(fraction, rows)
        tall, side = k > cols, min(k, cols)
        backend = dispatch.get_backend(preference if preference != "auto" else dispatch.auto_choice(side, True))
        padded = backend.gram_side(side)
        x = torch.empty((1, padded, max(k, cols)), dtype=torch.float16)
        out.append((x.mT if tall else x, tall, backend, None if tall else k))
    return out


def time_ns(shape: ModelShape, fraction: float, preference: str, steps: int, rounds: int) -> None:
    """Print the host ms of one step's Newton-Schulz (every batch once), products stubbed; the
    last product checked, as the step asks for it."""
    _keep_freed_memory()
    settings = NSSettings.from_config(Dion3Config())
    with products_stubbed():
        batches = ns_batches(shape, fraction, preference)

        def step() -> None:
            for x, tall, backend, rows in batches:
                orthogonalize(x, settings, backend, tall, True, ResultCheck(), rows)  # as the step

        for _ in range(3):
            step()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
        per_batch = []
        for x, tall, backend, rows in batches:
            t0 = time.perf_counter()
            for _ in range(steps):
                orthogonalize(x, settings, backend, tall, True, ResultCheck(), rows)  # as the step
            per_batch.append(((time.perf_counter() - t0) * 1e3 / steps, x, tall, backend))
    print(
        f"Newton-Schulz of {len(batches)} batches, f={fraction:g}: host ms per step (products stubbed) "
        f"median {statistics.median(times):.3f} (rounds {', '.join(f'{t:.3f}' for t in times)})"
    )
    for ms, x, tall, backend in per_batch:
        n, m = (x.shape[-1], x.shape[-2]) if tall else x.shape[-2:]
        print(f"  {n:5d} x {m:5d}{' (tall)' if tall else '':7s} {backend.name:6s} {ms:7.3f} ms")


def shrunk(shape: ModelShape, divisor: int, layers: int) -> ModelShape:
    """``shape`` with every width divided by ``divisor`` (at least 1 per head), ``layers`` deep."""
    heads, kv = shape.heads, shape.kv_heads
    return ModelShape(
        hidden=max(heads, shape.hidden // divisor),
        layers=layers,
        heads=heads,
        kv_heads=kv,
        mlp_hidden=max(1, shape.mlp_hidden // divisor),
        vocab=max(64, shape.vocab // divisor),
    )


def build(shape: ModelShape, fraction: float, flavor: str) -> tuple:
    """(step, optimizer) of an eager Dion3 on CPU whose step is handed the gradient norm (as under
    torchtitan with clipping), warmed up."""
    model = build_model(shape, torch.device("cpu"), None, 0)
    groups = build_param_groups(model.named_parameters(), adamw_lr=1e-3)
    opt = _ZeroNS(groups, lr=0.02, fraction=fraction, flavor=flavor, backend="triton", weight_decay=0.1)
    grads = GradFiller(model, torch.device("cpu"), 0)  # fixed gradients: their values do not matter here
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.locals]))

    def step() -> None:
        opt.use_gradient_norm(norm)
        opt.step()

    for _ in range(3):
        step()
    return step, opt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="7b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shrink", type=int, default=16, help="divide every width by this (the Python is the same)")
    p.add_argument("--flavor", default="normuon")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=50, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--part", default="step", choices=("step", "ns"), help="the step without NS, or NS alone")
    p.add_argument("--backend", default="auto", choices=dispatch.PREFERENCES, help="--part ns: the products' backend")
    a = p.parse_args(argv)
    if a.part == "ns":
        return time_ns(replace(MODELS[a.model], layers=1), a.fraction, a.backend, a.steps, a.rounds)
    shape = shrunk(MODELS[a.model], a.shrink, a.layers)
    with launches_stubbed():
        step, opt = build(shape, a.fraction, a.flavor)
        rounds = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            rounds.append((time.perf_counter() - t0) * 1e3 / a.steps)
        totals = timed_stages()
        for _ in range(a.steps):
            step()
    print(
        f"{a.model} shapes / {a.shrink}, {a.layers} layers, {a.flavor} f={a.fraction:g}, "
        f"{len(opt.shape_groups)} shape groups: host ms per step (kernels and Newton-Schulz stubbed) "
        f"median {statistics.median(rounds):.3f} (rounds {', '.join(f'{r:.3f}' for r in rounds)})"
    )
    print(f"by stage (one more round of {a.steps} steps, timed per stage):")
    for qual, (sec, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        if calls:
            print(f"  {qual:36s} {sec * 1e3 / a.steps:7.3f} ms  {calls / a.steps:5.1f} calls")


if __name__ == "__main__":
    main()
