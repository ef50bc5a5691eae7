"""Reference backend: every op of the kernel interface in plain PyTorch (CPU and any GPU).

All matrix ops take batched operands (L, n, k) @ (L, k, m). The ``sym_*`` ops may assume the
result is symmetric; here they are ordinary products whose lower triangle is then mirrored, so
their result is exactly symmetric on every backend (a library product need not be: it may sum
(i, j) and (j, i) in different orders).
"""

import torch

from dion3_titan.kernels.backend import Backend


def _fused_update_reference(
    weight: torch.Tensor,
    update: torch.Tensor,
    rows: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
) -> None:
    """weight (B, R, C) view; update (B, k, C); rows (B, k) int64 row indices into dim 1.

    weight <- decay * weight on every row, then weight[b, rows[b]] -= lr * update[b], computed
    in float32 (float64 for float64 weights) and rounded to the weight's dtype once.
    """
    wide = torch.promote_types(weight.dtype, torch.float32)
    w32 = weight.to(wide).mul_(decay)
    index = rows.unsqueeze(-1).expand(-1, -1, weight.shape[-1])
    selected = w32.gather(1, index).sub_(lr * update.to(wide))
    w32.scatter_(1, index, selected)
    weight.copy_(w32)


def mirror_lower(x: torch.Tensor) -> torch.Tensor:
    """x's lower triangle (diagonal included) and its transpose above the diagonal."""
    return x.tril() + x.tril(-1).mT


class TorchOps(Backend):
    name = "torch"

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.bmm(a, b, out=out)

    def mm_add(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        alpha: float,
        beta: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha, out=out)

    def sym_mm(self, a: torch.Tensor, b: torch.Tensor, zero_from: int | None = None) -> torch.Tensor:
        return mirror_lower(torch.bmm(a, b))

    def sym_addmm(
        self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float, zero_from: int | None = None
    ) -> torch.Tensor:
        return mirror_lower(torch.baddbmm(c, a, b, beta=beta, alpha=alpha))

    def fused_update(
        self,
        weight: torch.Tensor,
        update: torch.Tensor,
        rows: torch.Tensor,
        lr: torch.Tensor,
        decay: torch.Tensor,
    ) -> None:
        _fused_update_reference(weight, update, rows, lr, decay)
