"""The megabatch plan, built once at construction: matrices grouped by shape so each group is
orthogonalized as one batch (and, when sharded, moved with one collective each way).

The grouping rule lives here and nowhere else.
"""

import math
from dataclasses import dataclass, field

import torch

from dion3_titan.dist.comm import Exchange
from dion3_titan.dist.layout import MatrixLayout
from dion3_titan.optim.config import lr_scale


@dataclass
class Member:
    """One matrix parameter (possibly a stack of B matrices) inside a shape group."""

    param: torch.Tensor
    name: str
    layout: MatrixLayout
    k: int  # rows selected from each local (B, R, C) shard
    lr_scale: float
    offset: int = 0  # first index of its matrices in the group's (N, k, C) batch


@dataclass
class ShapeGroup:
    group_index: int  # the param group every member belongs to
    key: tuple
    members: list[Member] = field(default_factory=list)
    exchange: Exchange = field(default_factory=Exchange)

    @property
    def batch(self) -> int:
        return sum(m.layout.batch for m in self.members)


def rows_to_select(fraction: float, rows: int) -> int:
    """k = ceil(f * rows), at least one row when there are any."""
    if rows == 0:
        return 0
    return min(rows, max(1, math.ceil(fraction * rows - 1e-9)))


def group_key(group_index: int, layout: MatrixLayout, k: int, dtype: torch.dtype) -> tuple:
    """Matrices whose selected submatrices have the same full and local shapes, dtype and
    layout kind share one batch."""
    return (
        group_index,
        layout.global_rows,
        layout.global_cols,
        k,
        layout.local_cols,
        dtype,
        tuple((s.tensor_dim == layout.row_dim, s.size) for s in layout.shards),
    )


def build_groups(
    entries: list[tuple[int, torch.Tensor, str, MatrixLayout]], hyper: list[dict]
) -> list[ShapeGroup]:
    """``entries``: (param group index, param, name, layout); ``hyper[i]``: group i's options."""
    groups: dict[tuple, ShapeGroup] = {}
    for gi, p, name, layout in entries:
        h = hyper[gi]
        k = rows_to_select(h["fraction"], layout.local_rows)
        scale = lr_scale(layout.d_out, layout.d_in, h["lr_rule"], h["fraction"], h["fraction_lr_transfer"])
        key = group_key(gi, layout, k, p.dtype)
        g = groups.setdefault(key, ShapeGroup(gi, key))
        g.members.append(Member(p, name, layout, k, scale))
    for g in groups.values():
        offset = 0
        for m in g.members:
            m.offset = offset
            offset += m.layout.batch
    return list(groups.values())
