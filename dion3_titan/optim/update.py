"""The per-matrix stages of a Dion3 step on local (B, R, C) tensors: row selection, NorMuon
normalization, and the weight/momentum update with error feedback (paper Alg. 4)."""

import torch

from dion3_titan.kernels.backend import Backend


def select_rows(
    momentum: torch.Tensor, k: int, method: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Indices (B, k) of the k rows of ``momentum`` (B, R, C) with the largest l1 norm (or k
    random rows), sorted ascending so the selected submatrix keeps the rows' original order."""
    rows = momentum.shape[1]
    if k >= rows:
        return torch.arange(rows, device=momentum.device).expand(momentum.shape[0], rows)
    if method == "l1":
        score = torch.linalg.vector_norm(momentum, ord=1, dim=-1, dtype=torch.float32)
    else:
        score = torch.rand(momentum.shape[:2], device=momentum.device, generator=generator)
    return score.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


def row_index(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """(B, k) row indices expanded to (B, k, cols) for gather/scatter along dim 1."""
    return rows.unsqueeze(-1).expand(-1, -1, cols)


def take_rows(m: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return m.gather(1, row_index(rows, m.shape[-1]))


def normuon_normalize(
    o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon on orthogonalized rows o (N, k, C), in float32 (paper Sec. 6: lower precision
    here hurt). v (N, k) is the rows' second moment. Returns (o_hat, new v) where o_hat's rows
    are divided by sqrt(v) + eps and the whole matrix is rescaled to o's Frobenius norm."""
    o32 = o.float()
    v_new = v.float() * beta2 + (1.0 - beta2) * o32.square().mean(dim=-1)
    o_hat = o32 / (v_new.sqrt() + eps).unsqueeze(-1)
    norm_o = torch.linalg.vector_norm(o32, dim=(-2, -1), keepdim=True)
    norm_hat = torch.linalg.vector_norm(o_hat, dim=(-2, -1), keepdim=True)
    # A zero input (e.g. the lr=0 zero-gradient step that creates checkpoint state) stays zero.
    o_hat = o_hat * (norm_o / norm_hat.clamp_min(torch.finfo(torch.float32).tiny))
    return o_hat, v_new


def apply_update(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    update: torch.Tensor,
    rows: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
    mu: float,
    backend: Backend,
) -> None:
    """weight, momentum: (B, R, C) local views. Weight decay on every row, ``-lr * update`` on
    the selected rows (one rounding, in the backend's fused kernel), then error feedback:
    only the selected momentum rows decay by mu."""
    backend.fused_update(weight, update, rows, lr, decay)
    index = row_index(rows, momentum.shape[-1])
    momentum.scatter_(1, index, momentum.gather(1, index).mul_(mu))
