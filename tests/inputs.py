"""The tests' one generator of random gradients (and other seeded random tensors): drawn on the
CPU (the same numbers on every rank and every device), then placed on the default device (the
GPU copy of the engine checks sets it to CUDA)."""

from collections.abc import Iterable

import torch


def randn(shape, g: torch.Generator) -> torch.Tensor:
    """N(0, 1) of ``shape`` from the CPU generator ``g``, on the default device."""
    return torch.randn(*shape, generator=g, device="cpu").to(torch.get_default_device())


def random_grads(seed: int, shapes: Iterable, row_scale: bool = False) -> list[torch.Tensor]:
    """One N(0, 1) tensor per shape, in order, from one generator seeded with ``seed`` (callers
    pass a base plus the step: a fresh draw each step, never zeros). ``row_scale``: each row
    (vector along the last dim) times 1 + 5 U, U uniform on [0, 1), so that rows have distinct
    norms and a top-k selection is well defined."""
    g = torch.Generator().manual_seed(seed)
    grads = []
    for shape in shapes:
        grad = randn(shape, g)
        if row_scale:
            u = torch.rand(*shape[:-1], 1, generator=g, device="cpu").to(grad.device)
            grad = grad * (1 + 5 * u)
        grads.append(grad)
    return grads
