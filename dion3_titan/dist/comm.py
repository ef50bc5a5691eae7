"""Moving selected rows between the shards that hold them and the rank that orthogonalizes
them. An ``Exchange`` serves one shape group: ``gather`` assembles the full selected
submatrices a rank owns; ``scatter`` returns each shard its rows of the result.

Also counts every collective the optimizer issues (calls and received bytes).
"""

from dataclasses import dataclass

import torch


@dataclass
class CommStats:
    calls: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.calls += 1
        self.bytes += int(nbytes)

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0


class Exchange:
    """Single-process exchange: every matrix is whole and owned locally, nothing moves.

    ``rows`` (N, k, C) are the selected rows of the N local matrices of a group; ``v`` (N, k)
    their NorMuon second moments (or None). ``gather`` returns the owned full matrices
    (N_own, K, C_full) and their v; ``scatter`` maps owned results back to (N, k, C).
    """

    def gather(
        self, rows: torch.Tensor, v: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rows, v

    def scatter(
        self, result: torch.Tensor, v: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return result, v
