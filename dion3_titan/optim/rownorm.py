"""Periodic Row-wise Muon's RowNorm branch on local shards (paper Sec. 3.1-3.3, App. B.2).

RowNorm divides each row of the oriented momentum M~ = O(M) (rows = the smaller dimension) by
max(||row||_2, eps). On a sharded momentum a shard holds either whole oriented rows (the cut
dim is the row dim) or pieces of every row (the cut dim is the column dim, e.g. a tall matrix
under FSDP's Shard(0)). In the second case each rank sums the squares of its pieces and the
per-row sums are all-reduced; the (rows,) statistics of every such matrix travel packed in one
buffer per process group, never the matrix itself (App. B.2 proves this equals dense RowNorm).

Everything here works on local (B, R, C) views: B matrices, R oriented rows, C local columns.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dion3_titan.dist.comm import CommStats, all_reduce_bytes
from dion3_titan.dist.layout import MatrixLayout

# The process groups whose ranks hold the other pieces of a shard's oriented rows; () when the
# rows are complete locally.
SplitGroups = tuple[dist.ProcessGroup, ...]


def rownorm_row_dim(global_shape: Sequence[int]) -> int:
    """The paper's orientation O: the rows of W (-2) when d_out <= d_in, else its columns (-1).

    Taken from the global shape, not the shard, so every rank orients a matrix the same way.
    """
    return -2 if global_shape[-2] <= global_shape[-1] else -1


def orient(local: torch.Tensor, row_dim: int) -> torch.Tensor:
    """(B, R, C) view (no copy) of a 2D or 3D local tensor whose rows lie along ``row_dim``.
    (unsqueeze, not reshape(-1, ...): an empty shard of an uneven split has no inferable B.)"""
    m = local if local.ndim == 3 else local.unsqueeze(0)
    return m if row_dim == -2 else m.mT


def split_groups(layout: MatrixLayout, row_dim: int) -> SplitGroups:
    """The process groups of the mesh dims that cut the oriented column dim of ``layout``: each
    row's squared sum must be reduced over all of them (several when e.g. FSDP and TP both
    shard that dim). Mesh dims of size 1 cut nothing."""
    col_dim = -1 if row_dim == -2 else -2
    return tuple(layout.mesh.get_group(s.mesh_dim) for s in layout.shards if s.tensor_dim == col_dim and s.size > 1)


def row_sq_sums(x: torch.Tensor) -> torch.Tensor:
    """(B, R) float32 sums of squares of the local pieces of each row of x (B, R, C)."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).square()


def rownorm_direction(x: torch.Tensor, sq_sums: torch.Tensor, eps: float) -> torch.Tensor:
    """R_eps on x (B, R, C) given the rows' full squared sums (B, R): x_i / max(||x_i||, eps),
    in float32 (the update is rounded once, later, into the weight)."""
    denom = sq_sums.sqrt().clamp_min(eps)
    return x.float() / denom.unsqueeze(-1)


@dataclass
class PendingRowStats:
    """Row statistics whose cross-shard sums may still be in flight; ``wait`` returns them."""

    stats: list[torch.Tensor]
    _rounds: list[tuple[dist.ProcessGroup, list[int], torch.Tensor | None, dist.Work | None]]

    def wait(self) -> list[torch.Tensor]:
        for group, members, buf, work in self._rounds:
            if work is None:  # a later group: its input is the previous round's result
                buf = _pack([self.stats[j] for j in members])
                dist.all_reduce(buf, group=group)
            else:
                work.wait()
            _unpack(buf, members, self.stats)
        self._rounds = []
        return self.stats


class _Done:
    """A finished all-reduce (the synchronous path)."""

    def wait(self) -> None:
        return None


_DONE = _Done()


def _pack(stats: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([s.reshape(-1) for s in stats])


def _unpack(buf: torch.Tensor, members: list[int], stats: list[torch.Tensor]) -> None:
    offset = 0
    for j in members:
        n = stats[j].numel()
        stats[j] = buf[offset : offset + n].view_as(stats[j])
        offset += n


def reduce_row_stats(
    stats: list[torch.Tensor], splits: Sequence[SplitGroups], comm: CommStats | None = None
) -> PendingRowStats:
    """Start summing each ``stats[i]`` (B, R) over the ranks of ``splits[i]``.

    One all-reduce per distinct process group, packing the statistics of every matrix it cuts
    (one in total in the usual FSDP case). The first is launched asynchronously so the caller
    can work on complete-row matrices meanwhile; a matrix cut by two groups is summed over the
    first, then the second (a sum over the product of both). Groups are taken in first-seen
    order, identical on every rank because every rank lists the same parameters in order.
    """
    stats = list(stats)
    order: list[dist.ProcessGroup] = []
    members: dict[str, list[int]] = {}  # by group name: a mesh may hand out distinct handles
    for i, groups in enumerate(splits):
        for g in groups:
            if g.group_name not in members:
                order.append(g)
                members[g.group_name] = []
            members[g.group_name].append(i)
    rounds = []
    for n, group in enumerate(order):
        idx = members[group.group_name]
        if comm is not None:
            comm.add(all_reduce_bytes(sum(stats[j].numel() for j in idx), dist.get_world_size(group), 4))
        buf, work = None, None
        if n == 0:
            buf = _pack([stats[j] for j in idx])
            if dist.get_backend(group) == "gloo":
                # gloo's async work objects have been seen to abort a process at teardown
                # ("terminate called without an active exception"); CPU runs gain no overlap
                dist.all_reduce(buf, group=group)
                work = _DONE
            else:
                work = dist.all_reduce(buf, group=group, async_op=True)
        rounds.append((group, idx, buf, work))
    return PendingRowStats(stats, rounds)


def rownorm_shards(
    xs: Sequence[torch.Tensor],
    splits: Sequence[SplitGroups] | None = None,
    eps: float = 1e-8,
    comm: CommStats | None = None,
) -> list[torch.Tensor]:
    """Dense-equivalent RowNorm of oriented local shards ``xs`` (each (B, R, C)), float32.

    ``splits[i]`` names the groups holding the rest of ``xs[i]``'s rows (None: single process,
    every row complete). Equals slicing R_eps(O(M)) of the full matrices (App. B.2, Prop. 3),
    up to the reduction order of the sums.
    """
    splits = list(splits) if splits is not None else [()] * len(xs)
    split = [i for i, s in enumerate(splits) if s]
    pending = reduce_row_stats([row_sq_sums(xs[i]) for i in split], [splits[i] for i in split], comm)
    out: list[torch.Tensor | None] = [None] * len(xs)
    for i, x in enumerate(xs):  # complete rows first: overlaps the all-reduce in flight
        if not splits[i]:
            out[i] = rownorm_direction(x, row_sq_sums(x), eps)
    for i, sq in zip(split, pending.wait()):
        out[i] = rownorm_direction(xs[i], sq, eps)
    return out  # type: ignore[return-value]
