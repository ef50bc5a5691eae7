"""Across HSDP replicas: the replicate mesh dim of a data-parallel mesh (paper Sec. 7).

Under HSDP every parameter is replicated over R replicas and sharded over the S ranks of each.
With gradient sync (FSDP2's default) every replica holds the same gradients and, without more,
repeats the same Newton-Schulz. ``ReplicaSplit`` splits a shape group's owned batch over the
replicas instead: each orthogonalizes about N / R of its matrices and one all-to-all returns all
results (in the Newton-Schulz dtype; the flavor's normalization then runs on every replica).
With compressed sync the replicas hold different momenta (each its own gradients) and agree
only on the selected rows: the split first reduces them to their mean, which is exactly the
gradient-synced momentum because momentum is linear in the gradients.

Collectives here cross the "replicate" link (counted so in ``CommStats``).
"""

import math

import torch
import torch.distributed as dist

from dion3_titan.dist.comm import CommStats, all_reduce_bytes, all_to_all_bytes
from dion3_titan.dist.layout import is_dtensor, to_local

LINK = "replicate"


class ReplicaSplit:
    """One shape group's owned batch of ``n`` matrices, split over the ``size`` replicas of
    ``group`` (this rank is replica ``rank``): replica q orthogonalizes the matrices
    ``bounds[q]:bounds[q + 1]``, contiguous and as even as counts allow. The collectives are
    all-to-alls with exact splits, so no padding matrix ever travels."""

    def __init__(self, group, rank: int, size: int, n: int, mean: bool, stats: CommStats) -> None:
        self.group, self.rank, self.size, self.n = group, rank, size, n
        self.mean = mean  # the replicas' batches differ: take their mean (compressed sync)
        self.bounds = [q * n // size for q in range(size + 1)]
        self.counts = [self.bounds[q + 1] - self.bounds[q] for q in range(size)]
        self.own = self.counts[rank]
        self.stats = stats

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This replica's share of the owned batch x (n, K, C): the mean over replicas of their
        batches' share (one all-to-all: each replica receives the others' copies of its share
        and sums them) or, when the replicas hold the same batch, its slice."""
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        if not self.mean:
            return x[lo:hi]
        per = math.prod(x.shape[1:])
        out = x.new_empty((self.size, self.own, *x.shape[1:]))
        dist.all_to_all_single(
            out.view(-1), x.contiguous().view(-1), [self.own * per] * self.size, [c * per for c in self.counts],
            group=self.group,
        )
        self.stats.add(all_to_all_bytes([self.own * per] * self.size, self.rank, x.element_size()), LINK)
        return out.sum(dim=0).div_(self.size)

    def gather(self, result: torch.Tensor) -> torch.Tensor:
        """Every replica's share of the results, joined into the owned batch (n, K, C) on every
        replica (one all-to-all: this replica's share goes to each of the others)."""
        per = math.prod(result.shape[1:])
        send = result.contiguous().unsqueeze(0).expand(self.size, *result.shape).contiguous()
        out = result.new_empty((self.n, *result.shape[1:]))
        splits = [c * per for c in self.counts]
        dist.all_to_all_single(out.view(-1), send.view(-1), splits, [self.own * per] * self.size, group=self.group)
        self.stats.add(all_to_all_bytes(splits, self.rank, result.element_size()), LINK)
        return out


def agree_scores(scores: list[tuple[ReplicaSplit, torch.Tensor]]) -> list[torch.Tensor]:
    """Row scores every replica agrees on, for several shape groups at once: each the sum over
    replicas of each one's own (the compressed sync's l1 selection scores rows by the summed l1
    norms of the replicas' momenta, a proxy for the l1 norms of their mean, so that every replica
    selects alike). One all-reduce per replica group for all of a step's shape groups: at many
    nodes each is a latency across the network. Every rank passes its groups in the same order."""
    out: list[torch.Tensor | None] = [None] * len(scores)
    by_group: dict[tuple, list[int]] = {}  # by group name (a mesh may hand out distinct handles), dtype
    for i, (split, local) in enumerate(scores):
        by_group.setdefault((split.group.group_name, local.dtype), []).append(i)
    for idx in by_group.values():
        split = scores[idx[0]][0]
        parts = [scores[i][1] for i in idx]
        buf = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(buf, group=split.group)
        split.stats.add(all_reduce_bytes(buf.numel(), split.size, buf.element_size()), LINK)
        for i, part in zip(idx, buf.split([p.numel() for p in parts])):
            out[i] = part.view(scores[i][1].shape)
    return out  # type: ignore[return-value]


def replicate_dims(t: torch.Tensor) -> list[int]:
    """The mesh dims of size > 1 over which a DTensor is replicated (none for a plain tensor)."""
    if not is_dtensor(t):
        return []
    from torch.distributed.tensor import Replicate

    mesh = t.device_mesh
    return [d for d, p in enumerate(t.placements) if isinstance(p, Replicate) and mesh.size(d) > 1]


def average_over_replicas(tensors: list[torch.Tensor], stats: CommStats | None = None) -> None:
    """Each DTensor's local tensor replaced by its mean over the replicas of its replicate mesh
    dims, in place: one all-reduce per (process group, dtype), of all its tensors packed."""
    buckets: dict[tuple, list[tuple[dist.ProcessGroup, torch.Tensor]]] = {}
    for t in tensors:
        for d in replicate_dims(t):
            group = t.device_mesh.get_group(d)
            local = to_local(t)
            buckets.setdefault((group.group_name, local.dtype), []).append((group, local))
    for pairs in buckets.values():
        group, locals_ = pairs[0][0], [local for _, local in pairs]
        flat = torch.cat([local.reshape(-1) for local in locals_])
        dist.all_reduce(flat, group=group)
        size = dist.get_world_size(group)
        flat.div_(size)
        if stats is not None:
            stats.add(all_reduce_bytes(flat.numel(), size, flat.element_size()), LINK)
        offset = 0
        for local in locals_:
            local.copy_(flat[offset : offset + local.numel()].view_as(local))
            offset += local.numel()
