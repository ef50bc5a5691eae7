"""Stage 2 of a step: which rows of each matrix are orthogonalized (paper Alg. 4, line 3).

Rows are the output side (dim -2) whatever the sharding. ``l1`` picks each matrix's rows of
largest l1 norm, ``random`` draws them from a seed every rank shares; ``local`` scope takes the
top rows of each shard, ``global`` of the whole matrix (one all-gather of the shards' scores).
Both selections are the same for both stage implementations (optim/stages.py): only where the
l1 norms come from differs (the row engine's accumulate pass computes them).
"""

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dion3_titan.dist.comm import CommStats, full_row_scores
from dion3_titan.dist.layout import to_local
from dion3_titan.dist.plan import Member, ShapeGroup
from dion3_titan.dist.replicas import agree_scores
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.update import l1_scores, top_rows, top_rows_global


@dataclass(frozen=True)
class Selection:
    """The selected rows of a shape group's N local matrices."""

    rows: torch.Tensor  # (N, selected) row indices into each member's view, ascending
    valid: torch.Tensor | None  # (N, selected) False where a row only pads the buffer (global scope)
    every_row: bool  # f = 1: every row, in order (nothing to score or gather)

    def rows_of(self, members: list[Member]) -> tuple[torch.Tensor, ...]:
        """``rows`` split by member."""
        return self.rows.split([m.layout.batch for m in members])

    def valid_of(self, members: list[Member]) -> tuple[torch.Tensor, ...] | tuple[None, ...]:
        """``valid`` split by member (Nones when every selected row is real)."""
        if self.valid is None:
            return (None,) * len(members)
        return self.valid.split([m.layout.batch for m in members])


def every_row(sg: ShapeGroup, cfg: Dion3Config) -> bool:
    """True when selection would pick every local row (f = 1): then there is nothing to score
    or gather (and no score collective under column sharding)."""
    if sg.selected < sg.local_rows:
        return False
    return cfg.selection_scope == "local" or sg.global_k >= sum(sg.block_rows)


def _scored_across_replicas(sg: ShapeGroup, cfg: Dion3Config) -> bool:
    """Whether the replicas must agree on this group's l1 scores: under compressed sync they
    hold different momenta, and a selection of every row needs no scores."""
    split = sg.replicas
    return split is not None and split.mean and cfg.selection == "l1" and not every_row(sg, cfg)


def is_tall(sg: ShapeGroup, cfg: Dion3Config) -> bool:
    """Whether the real (unpadded) selected submatrix is tall, so Newton-Schulz works on its
    transpose (see orthogonalize())."""
    real_rows = sg.global_k if cfg.selection_scope == "global" else sum(min(sg.k, r) for r in sg.block_rows)
    return real_rows > sg.members[0].layout.global_cols


class RowSelector:
    """Selects rows for one optimizer: random selection's generators and seeds, and the small
    device constants a selection reads (made once, so a captured step reads them too)."""

    def __init__(self, comm_stats: CommStats) -> None:
        self.comm_stats = comm_stats
        self._rngs: dict[int, torch.Generator] = {}  # param group -> random selection
        self._seeds: dict[int, int] = {}  # param group -> this step's base seed
        self._consts: dict[tuple, torch.Tensor] = {}

    def seed(self, groups: list[ShapeGroup], configs: list, param_groups: list[dict]) -> None:
        """``selection = "random"``: each step's draws come from a generator seeded by (seed,
        step), the step counted in the param group, so a resumed run draws what the
        uninterrupted one would have (param groups are checkpointed)."""
        for gi in sorted({sg.group_index for sg in groups}):
            cfg, group = configs[gi], param_groups[gi]
            if cfg.selection != "random":
                continue
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    "selection='random' cannot run inside a captured CUDA graph (its seed changes "
                    "every step); use selection='l1' or cuda_graph=false"
                )
            step = group.setdefault("selection_step", 0)
            device = to_local(group["params"][0]).device
            gen = self._rngs.get(gi)
            if gen is None or gen.device != device:
                self._rngs[gi] = torch.Generator(device=device)
            self._seeds[gi] = cfg.seed * 1_000_003 + step
            group["selection_step"] = step + 1

    def agreed_l1(
        self, groups: list[tuple[ShapeGroup, Dion3Config, list[torch.Tensor], torch.Tensor | None]]
    ) -> dict[int, torch.Tensor]:
        """Compressed sync across replicas: the l1 scores of the shape groups that select by
        them, the same on every replica (their sum over the replicas), by id(group), in one
        collective per replica group for all of them (dist/replicas.py). ``groups``: (group,
        its settings, its members' momentum views, its rows' l1 norms when already known)."""
        scored = [(sg, views, l1) for sg, cfg, views, l1 in groups if _scored_across_replicas(sg, cfg)]
        local = [l1 if l1 is not None else torch.cat([l1_scores(v) for v in views]) for _, views, l1 in scored]
        agreed = agree_scores([(sg.replicas, scores) for (sg, _, _), scores in zip(scored, local)])
        return {id(sg): scores for (sg, _, _), scores in zip(scored, agreed)}

    def select(
        self, sg: ShapeGroup, cfg: Dion3Config, views: list[torch.Tensor], l1: torch.Tensor | None = None
    ) -> Selection:
        """The rows of ``views`` (each member's local (B, R, C) momentum) to orthogonalize.
        ``l1``: the rows' l1 norms (N, R) when already known (under compressed sync the agreed
        ones: ``agreed_l1``)."""
        device = views[0].device
        if every_row(sg, cfg):
            rows = self._const(
                ("all_rows", id(sg)), lambda: torch.arange(sg.local_rows, device=device).expand(sg.batch, -1)
            )
            return Selection(rows, None, True)
        n_rb, r_max = len(sg.block_rows), max(sg.block_rows)
        if cfg.selection == "random":  # same draws on every rank: a global score table
            scores = self._random_scores(sg, (sg.batch, n_rb, r_max), device)
        else:
            local = l1 if l1 is not None else torch.cat([l1_scores(v) for v in views])
            if sg.col_blocks > 1 or (cfg.selection_scope == "global" and n_rb > 1):
                local = torch.nn.functional.pad(local, (0, r_max - sg.local_rows))
                scores = full_row_scores(sg.exchange, local, self.comm_stats)
            else:
                return Selection(top_rows(local, sg.selected), None, False)
        if cfg.selection_scope == "global":
            block_rows = self._const(("block_rows", id(sg)), lambda: torch.tensor(sg.block_rows, device=device))
            rows, valid = top_rows_global(scores, block_rows, sg.row_block, sg.local_rows, sg.global_k, sg.selected)
            return Selection(rows, valid, False)
        return Selection(top_rows(scores[:, sg.row_block, : sg.local_rows], sg.selected), None, False)

    def _const(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._consts:
            self._consts[key] = make()
        return self._consts[key]

    def _random_scores(self, sg: ShapeGroup, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """This step's random scores of one shape group. Each group draws from its own seed
        (the step's seed and the group's key), so every rank draws the same table for it even
        where an earlier group's local batch differs between ranks (an unevenly sharded stack)."""
        gen = self._rngs[sg.group_index]
        gen.manual_seed(self._seeds[sg.group_index] + zlib.crc32(repr(sg.key).encode()))
        return torch.rand(shape, device=device, generator=gen)
