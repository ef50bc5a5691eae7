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
from torch.nn.functional import pad

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


def _scored_across_shards(sg: ShapeGroup, cfg: Dion3Config) -> bool:
    """Whether a group's row scores need the other shards' (an all-gather): its columns are
    sharded (each rank holds partial row sums), or global scope picks over all row blocks."""
    return sg.col_blocks > 1 or (cfg.selection_scope == "global" and len(sg.block_rows) > 1)


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

    def scores(
        self, groups: list[tuple[ShapeGroup, Dion3Config, list[torch.Tensor], torch.Tensor | None]]
    ) -> dict[int, torch.Tensor]:
        """The l1 scores of a step's shape groups that select by them, by id(group), with their
        collectives batched over the groups: across HSDP replicas under compressed sync (the
        replicas hold different momenta: each row scores the sum over replicas of their l1
        norms, so that all select alike) one all-reduce per replica group; where a group's rows
        are scored across its shard group (columns sharded, or global scope) one all-gather per
        shard group. At many nodes each collective is a network latency, once per step instead
        of once per distinct matrix shape. ``groups``: (group, its settings, its members'
        momentum views, its rows' l1 norms when already known). Each entry is the group's local
        scores (N, R), or its score table (N, n_row_blocks, R_max) where scored across shards.
        Every rank passes its groups in the same order."""
        scored = [
            (sg, cfg, l1 if l1 is not None else torch.cat([l1_scores(v) for v in views]))
            for sg, cfg, views, l1 in groups
            if cfg.selection == "l1" and not every_row(sg, cfg)
        ]
        out = {id(sg): local for sg, _, local in scored}
        agreeing = [sg for sg, _, _ in scored if sg.replicas is not None and sg.replicas.mean]
        agreed = agree_scores([(sg.replicas, out[id(sg)]) for sg in agreeing])
        out.update((id(sg), scores) for sg, scores in zip(agreeing, agreed))
        tabled = [(sg, out[id(sg)]) for sg, cfg, _ in scored if _scored_across_shards(sg, cfg)]
        padded = [(sg.exchange, pad(local, (0, max(sg.block_rows) - sg.local_rows))) for sg, local in tabled]
        for (sg, _), table in zip(tabled, full_row_scores(padded, self.comm_stats)):
            out[id(sg)] = table
        return out

    def select(
        self, sg: ShapeGroup, cfg: Dion3Config, views: list[torch.Tensor], scores: torch.Tensor | None = None
    ) -> Selection:
        """The rows of ``views`` (each member's local (B, R, C) momentum) to orthogonalize.
        ``scores``: the group's entry of ``scores`` (l1 selection of some rows; else None)."""
        device = views[0].device
        if every_row(sg, cfg):
            rows = self._const(
                ("all_rows", id(sg)), lambda: torch.arange(sg.local_rows, device=device).expand(sg.batch, -1)
            )
            return Selection(rows, None, True)
        if cfg.selection == "random":  # same draws on every rank: a global score table
            table = self._random_scores(sg, (sg.batch, len(sg.block_rows), max(sg.block_rows)), device)
        else:
            table = scores
            if not _scored_across_shards(sg, cfg):
                return Selection(top_rows(table, sg.selected), None, False)
        if cfg.selection_scope == "global":
            block_rows = self._const(("block_rows", id(sg)), lambda: torch.tensor(sg.block_rows, device=device))
            rows, valid = top_rows_global(table, block_rows, sg.row_block, sg.local_rows, sg.global_k, sg.selected)
            return Selection(rows, valid, False)
        return Selection(top_rows(table[:, sg.row_block, : sg.local_rows], sg.selected), None, False)

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
