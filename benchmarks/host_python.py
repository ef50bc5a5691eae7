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
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (below, through dion3_titan)

import torch  # noqa: E402

from benchmarks.host_profile import timed_stages  # noqa: E402
from benchmarks.llama import MODELS, GradFiller, ModelShape, build_model  # noqa: E402
from dion3_titan import Dion3  # noqa: E402
from dion3_titan.kernels import row_engine  # noqa: E402
from dion3_titan.optim.routing import build_param_groups  # noqa: E402


class _ZeroNS(Dion3):
    """Dion3 whose Newton-Schulz hands back zeros (one buffer per shape, kept)."""

    def __init__(self, *args, **kwargs) -> None:
        self._zero_batches: dict[tuple, torch.Tensor] = {}
        super().__init__(*args, **kwargs)

    def _orthogonalize(self, g, owned, backend, tall, normalized):  # noqa: ANN001, ANN202 (Dion3's signature)
        key = (tuple(owned.shape), g.ns.dtype)
        if key not in self._zero_batches:
            self._zero_batches[key] = torch.zeros(owned.shape, dtype=g.ns.dtype)
        return self._zero_batches[key]


@contextlib.contextmanager
def launches_stubbed() -> Iterator[None]:
    """The row engine's kernel launches do nothing inside the block."""
    real = row_engine.launch
    row_engine.launch = lambda *args, **kwargs: None
    try:
        yield
    finally:
        row_engine.launch = real


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
    a = p.parse_args(argv)
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
