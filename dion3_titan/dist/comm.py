"""Moving selected rows between the shards that hold them and the rank that orthogonalizes
them. One ``Exchange`` serves one shape group: ``gather`` assembles the full selected
submatrices this rank owns, ``scatter`` returns every shard its rows of the results.

Rows travel as fixed-size blocks: each rank contributes ``k`` rows (zero-padded) by ``cols``
columns (zero-padded) per matrix, so every buffer size is known when the plan is built and the
step needs no host synchronization. Zero rows and zero columns do not change polar(X) on the
others (polar commutes with row and column permutations and keeps zero rows zero), so the
padding only costs FLOPs. An optional trailing per-row scalar (NorMuon's second moment) rides
along as one extra column.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch >= 2.13 renames all_gather_into_tensor (output: inputs concatenated along dim 0).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommStats:
    """Collectives issued by the optimizer: calls, and the bytes this rank receives from other
    ranks (what crosses a link; a rank's own block does not), in total and per link: "shard"
    for the ranks of one replica (FSDP, TP, EP dims), "replicate" across HSDP replicas. Each
    collective counts its bytes by the formulas below, which the comm model of the benchmarks
    (benchmarks/comm_model.py) reuses."""

    calls: int = 0
    bytes: int = 0
    by_link: dict[str, int] = field(default_factory=dict)

    def add(self, nbytes: int, link: str = "shard") -> None:
        self.calls += 1
        self.bytes += int(nbytes)
        self.by_link[link] = self.by_link.get(link, 0) + int(nbytes)

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.by_link = {}

    def copy(self) -> "CommStats":
        return CommStats(self.calls, self.bytes, dict(self.by_link))


def all_to_all_bytes(recv_splits: list[int], rank: int, element_size: int) -> int:
    """Bytes received from the other ranks by an ``all_to_all_single`` (splits in elements)."""
    return (sum(recv_splits) - recv_splits[rank]) * element_size


def all_gather_bytes(chunk_numel: int, size: int, element_size: int) -> int:
    """Bytes received by an all-gather of ``chunk_numel`` elements per rank over ``size`` ranks."""
    return (size - 1) * chunk_numel * element_size


def reduce_scatter_bytes(chunk_numel: int, size: int, element_size: int) -> int:
    """Bytes received by a ring reduce-scatter whose output is ``chunk_numel`` elements per rank."""
    return (size - 1) * chunk_numel * element_size


def all_reduce_bytes(numel: int, size: int, element_size: int) -> int:
    """Bytes received by a ring all-reduce of ``numel`` elements (a reduce-scatter, then an
    all-gather, of its 1/size chunks)."""
    return 2 * (size - 1) * -(-numel // size) * element_size


class Exchange:
    """Single process (or every matrix whole on this rank): nothing moves.

    ``gather(rows, extra)``: rows (N, k, C) of the group's N local matrices, extra (N, k, E)
    float32 per-row scalars or None. Returns the owned full matrices (N_own, K, C_full) and
    their extra (N_own, K, E). ``scatter(result, extra)`` is its inverse on results. Every
    rank passes the same E.
    """

    moves_data = False  # gather/scatter hand back their input: the owner's batch is the local one

    def gather(
        self, rows: torch.Tensor, extra: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rows, extra

    def scatter(
        self, result: torch.Tensor, extra: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return result, extra


def extra_columns(dtype: torch.dtype) -> int:
    """Columns that a float32 per-row scalar takes in rows of ``dtype``: one, or two of a 16-bit
    dtype, which carry its bits unchanged (the rows of NS's input and results travel in
    float16; NorMuon's second moment and factors beside them must not lose precision)."""
    return 2 if dtype.itemsize == 2 else 1


def append_extra(x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """x (..., C) with the per-row float32 scalars ``extra`` (..., E) as its last columns."""
    if extra is None:
        return x
    if extra_columns(x.dtype) == 1:
        return torch.cat([x, extra.to(x.dtype)], dim=-1)
    return torch.cat([x, extra.to(torch.float32).contiguous().view(x.dtype)], dim=-1)


def split_extra(x: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``append_extra``'s inverse: (the first ``cols`` columns, the per-row scalars (..., E))."""
    tail = x[..., cols:]
    if extra_columns(x.dtype) == 1:
        return x[..., :cols], tail
    return x[..., :cols], tail.contiguous().view(torch.float32)


def extra_width(dtype: torch.dtype, extra: torch.Tensor | None) -> int:
    """The columns ``append_extra`` adds to rows of ``dtype``."""
    return 0 if extra is None else extra.shape[-1] * extra_columns(dtype)


class ShardedExchange(Exchange):
    """Matrices cut by one or more mesh dims (FSDP rows, TP rows or columns): per group, one
    ``all_to_all_single`` brings every shard's selected rows to the matrix's owner and one
    returns the results.

    The gather group's ranks form a grid of row blocks x column blocks (``row_block[g]``,
    ``col_block[g]`` for group rank g). The owner lays the received blocks out on that grid.
    """

    moves_data = True

    def __init__(
        self,
        group,
        rank: int,
        row_block: list[int],
        col_block: list[int],
        owners: list[int],
        k: int,
        cols: int,
        stats: CommStats,
    ) -> None:
        self.group = group
        self.rank = rank
        self.size = len(row_block)
        self.n_rb = max(row_block) + 1
        self.n_cb = max(col_block) + 1
        self.k, self.cols = k, cols
        self.stats = stats
        self.counts = [owners.count(q) for q in range(self.size)]
        self.owned = [j for j, o in enumerate(owners) if o == rank]
        self.n_own = len(self.owned)
        order = [j for q in range(self.size) for j in range(len(owners)) if owners[j] == q]
        self.order = torch.tensor(order, dtype=torch.long)
        # group ranks sorted into grid order (row block major, column block minor)
        grid = sorted(range(self.size), key=lambda g: (row_block[g], col_block[g]))
        self.grid = torch.tensor(grid, dtype=torch.long)
        self.ungrid = torch.argsort(self.grid)
        self._device = None

    def _to(self, device: torch.device) -> None:
        if self._device != device:
            self.order, self.grid, self.ungrid = (t.to(device) for t in (self.order, self.grid, self.ungrid))
            self._device = device

    def _all_to_all(self, send: torch.Tensor, out_numel: int, out_splits, in_splits) -> torch.Tensor:
        out = send.new_empty(out_numel)
        dist.all_to_all_single(out, send, out_splits, in_splits, group=self.group)
        self.stats.add(all_to_all_bytes(out_splits, self.rank, out.element_size()))
        return out

    def _splits(self, width: int) -> tuple[list[int], list[int]]:
        """(per rank: the elements this rank's shards send it, the elements its owner returns)."""
        block = self.k * width
        return [c * block for c in self.counts], [self.n_own * block] * self.size

    def gather(self, rows, extra):
        self._to(rows.device)
        k, c, nrb, ncb, n = self.k, self.cols, self.n_rb, self.n_cb, self.n_own
        width = c + extra_width(rows.dtype, extra)
        send_splits, recv_splits = self._splits(width)
        send = append_extra(rows, extra).index_select(0, self.order).reshape(-1)
        out = self._all_to_all(send, sum(recv_splits), recv_splits, send_splits)
        blocks = out.view(self.size, n, k, width).index_select(0, self.grid)
        blocks = blocks.view(nrb, ncb, n, k, width)
        full = blocks[..., :c].permute(2, 0, 3, 1, 4).reshape(n, nrb * k, ncb * c)
        if extra is None:
            return full, None
        # identical on every column block: take the first
        full_extra = split_extra(blocks[:, 0], c)[1].permute(1, 0, 2, 3)
        return full, full_extra.reshape(n, nrb * k, extra.shape[-1])

    def scatter(self, result, extra):
        self._to(result.device)
        k, c, nrb, ncb, n = self.k, self.cols, self.n_rb, self.n_cb, self.n_own
        width = c + extra_width(result.dtype, extra)
        send_splits, recv_splits = self._splits(width)
        blocks = result.view(n, nrb, k, ncb, c).permute(1, 3, 0, 2, 4)
        if extra is not None:
            e = extra.view(n, nrb, k, extra.shape[-1]).permute(1, 0, 2, 3)
            blocks = append_extra(blocks, e.unsqueeze(1).expand(nrb, ncb, *e.shape[1:]))
        send = blocks.reshape(self.size, n, k, width).index_select(0, self.ungrid).reshape(-1)
        out = self._all_to_all(send, sum(send_splits), send_splits, recv_splits)
        local = torch.empty(len(self.order), k, width, dtype=out.dtype, device=out.device)
        local.index_copy_(0, self.order, out.view(-1, k, width))
        if extra is None:
            return local, None
        return split_extra(local, c)


class ReplicatedExchange(Exchange):
    """Whole matrices replicated on every rank of a group (DDP): each rank orthogonalizes its
    share and one ``all_gather_into_tensor`` hands every rank all results."""

    moves_data = True

    def __init__(self, group, rank: int, size: int, owners: list[int], stats: CommStats) -> None:
        self.group = group
        self.size = size  # the group's ranks (a small local batch leaves some owning nothing)
        self.stats = stats
        self.n_max = max(owners.count(q) for q in range(self.size))
        # slot s of rank q holds matrix slots[q][s] (padded by repeating a matrix, discarded)
        self.slots = [[j for j, o in enumerate(owners) if o == q] for q in range(self.size)]
        mine = self.slots[rank]
        self.mine = torch.tensor(mine + [mine[-1] if mine else 0] * (self.n_max - len(mine)), dtype=torch.long)
        gather_pos = [q * self.n_max + s for q in range(self.size) for s in range(len(self.slots[q]))]
        order = [j for q in range(self.size) for j in self.slots[q]]
        self.back = torch.empty(len(order), dtype=torch.long)
        self.back[torch.tensor(order, dtype=torch.long)] = torch.tensor(gather_pos, dtype=torch.long)
        self._device = None

    def _to(self, device):
        if self._device != device:
            self.mine, self.back = self.mine.to(device), self.back.to(device)
            self._device = device

    def gather(self, rows, extra):
        self._to(rows.device)
        return rows.index_select(0, self.mine), None if extra is None else extra.index_select(0, self.mine)

    def scatter(self, result, extra):
        self._to(result.device)
        packed = append_extra(result, extra)
        out = packed.new_empty(self.size * packed.shape[0], *packed.shape[1:])
        all_gather_into(out, packed.contiguous(), group=self.group)
        self.stats.add(all_gather_bytes(packed.numel(), self.size, out.element_size()), link="replicate")
        out = out.index_select(0, self.back)
        if extra is None:
            return out, None
        return split_extra(out, result.shape[-1])


def summed_over_shards(parts: list[tuple[Exchange, torch.Tensor]], stats: CommStats) -> list[torch.Tensor]:
    """Each (exchange, local) with local a per-matrix partial sum (N,) over this rank's part of
    the group's matrices: the sum over the exchange's ranks where a ``ShardedExchange`` cuts
    them (else local, the whole). One ``all_reduce`` per shard group for all of the groups.
    Every rank passes its groups in the same order."""
    out = [local for _, local in parts]
    by_group: dict[tuple, list[int]] = {}
    for i, (exchange, local) in enumerate(parts):
        if isinstance(exchange, ShardedExchange):
            by_group.setdefault((exchange.group.group_name, local.dtype), []).append(i)
    for idx in by_group.values():
        group, size = parts[idx[0]][0].group, parts[idx[0]][0].size
        flat = torch.cat([parts[i][1] for i in idx])
        dist.all_reduce(flat, group=group)
        stats.add(all_reduce_bytes(flat.numel(), size, flat.element_size()))
        for i, total in zip(idx, flat.split([parts[i][1].numel() for i in idx])):
            out[i] = total
    return out


def full_row_scores(parts: list[tuple[Exchange, torch.Tensor]], stats: CommStats) -> list[torch.Tensor]:
    """Row scores of every row block, for several shape groups: each (exchange, local) with
    local (N, R_max) partial sums over this rank's columns -> (N, n_row_blocks, R_max) summed
    over column blocks. One ``all_gather`` per shard group for all of the groups (only needed
    for column-sharded matrices or global selection). Every rank passes its groups in the same
    order."""
    out: list[torch.Tensor | None] = [None] * len(parts)
    by_group: dict[tuple, list[int]] = {}
    for i, (exchange, local) in enumerate(parts):
        if isinstance(exchange, ShardedExchange):
            by_group.setdefault((exchange.group.group_name, local.dtype), []).append(i)
        else:
            out[i] = local.unsqueeze(1)
    for idx in by_group.values():
        group, size = parts[idx[0]][0].group, parts[idx[0]][0].size
        flat = torch.cat([parts[i][1].reshape(-1) for i in idx])
        gathered = flat.new_empty(size * flat.numel())
        all_gather_into(gathered, flat, group=group)
        stats.add(all_gather_bytes(flat.numel(), size, flat.element_size()))
        for i, chunk in zip(idx, gathered.view(size, -1).split([parts[i][1].numel() for i in idx], dim=1)):
            exchange, local = parts[i]
            grid = chunk.reshape(size, *local.shape).index_select(0, exchange.grid.to(chunk.device))
            out[i] = grid.view(exchange.n_rb, exchange.n_cb, *local.shape).sum(dim=1).transpose(0, 1)
    return out  # type: ignore[return-value]
