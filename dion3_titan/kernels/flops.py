"""The Newton-Schulz FLOP model: what orthogonalizing one n x m matrix costs, product by product.

The megabatch plan balances owners by it (dist/plan.py) and the step benchmark counts the FLOPs a
rank runs with it (its "NS TFLOP" column); "symmetric" counts products that a symmetric kernel
computes by halves (the Triton and CuteDSL backends) at half cost.
"""

from dion3_titan.kernels.dispatch import resolve_algorithm


def standard_ns_flops(n: int, m: int, steps: int, symmetric: bool) -> float:
    """Standard NS on an n x m (n <= m) matrix: per step X X^T (2mn^2), A^2 (2n^3), B X (2mn^2);
    symmetric kernels halve the first two (paper Sec. 2.3: 5(4mn^2 + 2n^3) -> 5(3mn^2 + n^3))."""
    half = 1 if symmetric else 2
    return steps * (half * m * n * n + half * n**3 + 2 * m * n * n)


def gram_ns_flops(n: int, m: int, steps: int, restarts: tuple[int, ...], symmetric: bool) -> float:
    """Gram NS (paper Alg. 3 as in optim/orthogonalize.py) on an n x m (n <= m) matrix. With
    T = 5 and a restart at 2: 14 n x n products and X X^T twice, Q X twice, i.e. 14n^3 + 6n^2 m
    with symmetric kernels, 28n^3 + 8n^2 m without."""
    half = 1 if symmetric else 2
    gram = half * m * n * n  # R = X X^T
    small = half * n**3  # a symmetric n x n product
    total = gram
    q_identity = True
    for t in range(steps):
        if t > 0 and t in restarts:
            if not q_identity:
                total += 2 * m * n * n  # X <- Q X
            total += gram
            q_identity = True
        total += small  # Z = b R + c R^2
        if not q_identity:
            total += small  # Q <- Q Z + a Q
        q_identity = False
        if t + 1 < steps and (t + 1) not in restarts:
            total += 2 * small  # RZ, then R <- Z RZ
    return total + 2 * m * n * n  # Q X


def ns_flops(rows: int, cols: int, algorithm: str, steps: int, restarts: tuple[int, ...], symmetric: bool) -> float:
    """FLOPs of orthogonalizing one rows x cols matrix (either orientation) with ``algorithm``
    ("gram" | "standard" | "auto", resolved as the optimizer resolves it)."""
    n, m = min(rows, cols), max(rows, cols)
    if resolve_algorithm(algorithm, n, m) == "gram":
        return gram_ns_flops(n, m, steps, restarts, symmetric)
    return standard_ns_flops(n, m, steps, symmetric)
