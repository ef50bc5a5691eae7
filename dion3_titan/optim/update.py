"""The per-matrix stages of a Dion3 step on local (B, R, C) tensors: row selection, NorMuon
normalization, and the weight/momentum update with error feedback (paper Alg. 4)."""

import torch

from dion3_titan.kernels.backend import Backend


def l1_scores(momentum: torch.Tensor) -> torch.Tensor:
    """Row l1 norms (B, R) in float32 of momentum (B, R, C) (summed in float64 for float64
    momentum: the norm may widen its input, never narrow it)."""
    wide = torch.promote_types(momentum.dtype, torch.float32)
    return torch.linalg.vector_norm(momentum, ord=1, dim=-1, dtype=wide).float()


def top_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (N, k) of the k largest scores per row of (N, R), ascending, so the selected
    submatrix keeps the rows' original order."""
    if k >= scores.shape[1]:
        return torch.arange(scores.shape[1], device=scores.device).expand(scores.shape[0], -1)
    return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


def top_rows_global(
    scores: torch.Tensor, block_rows: torch.Tensor, block: int, local_rows: int, k: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global selection. ``scores`` (N, n_blocks, R_max) hold the scores of every row block
    (block b has ``block_rows[b]`` real rows; a device tensor, this rank's block has
    ``local_rows``). The k best rows of the whole matrix are chosen;
    returns this block's chosen rows as ``capacity`` indices (N, capacity) and a mask (N,
    capacity) of which are really chosen (the rest pad the fixed-size buffer)."""
    n, n_blocks, r_max = scores.shape
    real = torch.arange(r_max, device=scores.device) < block_rows[:, None]
    flat = scores.masked_fill(~real, float("-inf")).reshape(n, n_blocks * r_max)
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen.scatter_(1, flat.topk(k, dim=1, sorted=False).indices, True)
    mine = chosen.view(n, n_blocks, r_max)[:, block, :local_rows]
    rows = mine.float().topk(capacity, dim=1, sorted=False).indices.sort(dim=1).values
    return rows, mine.gather(1, rows)


def row_index(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """(B, k) row indices expanded to (B, k, cols) for gather/scatter along dim 1."""
    return rows.unsqueeze(-1).expand(-1, -1, cols)


def take_rows(m: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return m.gather(1, row_index(rows, m.shape[-1]))


def normuon_factors(
    o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NorMuon on orthogonalized rows o (N, k, C), in float32 (paper Sec. 6: lower precision
    here hurt), as factors: (row denominators sqrt(v_new) + eps (N, k), matrix scales (N,),
    v_new). v (N, k) is the rows' second moment; ``cols`` the real column count (o may carry
    zero padding columns). ``apply_row_factors`` makes the normalized rows: each divided by
    its denominator, the whole matrix rescaled to o's Frobenius norm."""
    o32 = o.float()
    v_new = v.float() * beta2 + (1.0 - beta2) * o32.square().sum(dim=-1) / cols
    den = v_new.sqrt() + eps
    norm_o = torch.linalg.vector_norm(o32, dim=(-2, -1))
    norm_hat = torch.linalg.vector_norm(o32 / den.unsqueeze(-1), dim=(-2, -1))
    # A zero input (e.g. the lr=0 zero-gradient step that creates checkpoint state) stays zero.
    return den, norm_o / norm_hat.clamp_min(torch.finfo(torch.float32).tiny), v_new


def apply_row_factors(o: torch.Tensor, den: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """o (N, k, C) in float32, each row divided by ``den`` (N, k), each matrix times ``scale``
    (N,): where the factors of ``normuon_factors`` travel with NS's result, the receiver's rows
    are the owner's to the bit."""
    return o.float() / den.unsqueeze(-1) * scale[:, None, None]


def normuon_normalize(
    o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's normalized rows and new second moment, (o_hat, v_new) (``normuon_factors``)."""
    den, scale, v_new = normuon_factors(o, v, beta2, eps, cols)
    return apply_row_factors(o, den, scale), v_new


def apply_update(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    update: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor | None,
    lr: torch.Tensor,
    decay: torch.Tensor,
    mu: torch.Tensor,
    backend: Backend,
    every_row: bool = False,
) -> None:
    """weight, momentum: (B, R, C) local views. Weight decay on every row, ``-lr * update`` on
    the selected rows (one rounding, in the backend's fused kernel), then error feedback:
    only the selected momentum rows decay by mu. Rows with ``valid`` False only pad a buffer:
    their update is zero and their momentum is left alone. ``every_row``: rows is every row
    in order (f = 1), so the momentum decays in place without a gather/scatter. ``lr``,
    ``decay`` and ``mu`` are 0-dim float32 device tensors (live under CUDA-graph replay)."""
    backend.fused_update(weight, update, rows, lr, decay)
    if every_row and valid is None:
        momentum.mul_(mu)
        return
    index = row_index(rows, momentum.shape[-1])
    factor = mu if valid is None else torch.where(valid, mu, 1.0).unsqueeze(-1).to(momentum.dtype)
    momentum.scatter_(1, index, momentum.gather(1, index).mul_(factor))
