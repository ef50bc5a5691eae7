"""The checked products' device tests (``Backend.mm_checked``'s kernels) share their operands
and their verdict: matrix 1 gets a NaN in C, matrix 2 an inf in A, matrix 3 a row whose product
passes the dtype's range, matrix 0 stays clean."""

from collections.abc import Callable

import torch

BIG = {torch.float16: 4e4, torch.bfloat16: 3e38}  # finite inputs whose products overflow the dtype


def poisoned_operands(L: int, n: int, k: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """a (L, n, k), b (L, k, m) and c (L, n, m) on the GPU, poisoned as the module says (L >= 4,
    n > 100, k > 5, m > 33); b is positive, so row 7 of matrix 3 cannot cancel back into range."""
    a = torch.randn(L, n, k, device="cuda").to(dtype)
    b = torch.randn(L, k, m, device="cuda").abs().to(dtype)
    c = torch.randn(L, n, m, device="cuda").to(dtype)
    a[2, 100, 5] = float("inf")
    a[3, 7, :] = BIG[dtype]
    c[1, 20, 33] = float("nan")
    return a, b, c


def assert_flags_the_poisoned(
    product: Callable[[torch.Tensor | None], torch.Tensor | None], with_c: bool, seed: int
) -> None:
    """``product(flags)`` (flags None: unchecked) flags exactly the matrices whose result is not
    finite, leaves a flag set before on a finite one, and gives the unchecked result's bits."""
    plain = product(None)
    flags = torch.tensor([5, 0, 0, 0], dtype=torch.int32, device="cuda")  # 5: set before, never cleared
    got = product(flags)
    assert got is not None and plain is not None
    torch.cuda.synchronize()
    want = (~torch.isfinite(plain).flatten(1).all(1)).int()
    assert want.tolist() == [0, int(with_c), 1, 1], f"the poisoned inputs did not poison (seed {seed})"
    want[0] = 5
    assert flags.tolist() == want.tolist(), f"flags {flags.tolist()} (seed {seed})"
    assert torch.equal(got.nan_to_num(), plain.nan_to_num()), f"the check changed the result (seed {seed})"
