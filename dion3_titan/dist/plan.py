"""The megabatch plan, built once at construction.

Matrices are grouped by shape (and layout) so that each group is orthogonalized as one batch
and, when sharded, moved with one collective each way. Owners of sharded matrices are chosen
to balance Newton-Schulz FLOPs across the ranks of each gather group. The grouping rule and
the owner rule live here and nowhere else.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dion3_titan.dist.comm import CommStats, Exchange, ReplicatedExchange, ShardedExchange
from dion3_titan.dist.layout import MatrixLayout
from dion3_titan.dist.replicas import ReplicaSplit
from dion3_titan.kernels.flops import ns_flops


@dataclass(frozen=True)
class PlanSettings:
    """What the plan reads of one matrix param group's settings (optim/config.py owns them)."""

    fraction: float  # share of rows each matrix contributes per step
    selection_scope: str  # "local": k of each shard's rows; "global": of the whole matrix
    megabatch: bool  # one batch per shape group; False: batches of as many matrices as shards
    ns_algorithm: str  # the Newton-Schulz cost that owners are balanced on
    ns_steps: int
    ns_restarts: tuple[int, ...]
    replicate_sync: str = "gradients"  # "compressed": the replicas' momenta differ (replicas.py)
    replicate_ns: str = "repeat"  # "split": each replica orthogonalizes a share of every group


@dataclass(frozen=True)
class PlanEntry:
    """One matrix parameter, or one piece of a split parameter (``piece_index`` set), in a
    rank-independent order."""

    group_index: int  # its param group
    param: torch.Tensor
    name: str
    layout: MatrixLayout  # the piece's, for a piece
    lr_scale: float  # multiplier of the update's learning rate (optim/config.py lr_scale)
    piece_index: int | None = None


@dataclass
class Member:
    """One matrix parameter (possibly a stack of B matrices) inside a shape group, or one
    piece of a split parameter (optim/split.py): a row slice of dim -2 that is its own matrix
    (own k, lr scale, shape group and NorMuon state). ``layout`` describes what the member
    is (the piece, when there is one)."""

    param: torch.Tensor
    name: str
    layout: MatrixLayout
    lr_scale: float
    offset: int = 0  # first index of its matrices in the group's batch
    piece_index: int | None = None  # which piece of ``param`` (None: the whole parameter)

    @property
    def piece(self) -> slice | None:
        """Global rows (dim -2) of the parameter this member is; None for the whole of it."""
        return self.layout.piece

    @property
    def variance_key(self) -> str:
        """State key of this member's NorMuon second moment. A piece that selects rows reads
        its rows of the parameter's one row state ("variance", over all of dim -2): a state
        laid out like the parameter's rows reshards under any sharding, however the shards
        cut the piece. A piece that selects columns has a state of its own."""
        if self.piece_index is None or self.layout.row_dim == -2:
            return "variance"
        return f"variance.{self.piece_index}"

    def variance_view(self, local: torch.Tensor) -> torch.Tensor:
        """(B, R) view of this member's rows in the local part of its ``variance_key`` state."""
        if self.piece_index is not None and self.layout.row_dim == -2:
            local = local[..., self.layout.local_piece]
        return local.view(self.layout.batch, self.layout.local_rows)

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """(B, R, C) view of this member in a local tensor shaped like the parameter's shard
        (no copy: writes go through to ``local``)."""
        return self.layout.piece_view(local)


@dataclass
class ShapeGroup:
    group_index: int  # the param group every member belongs to
    key: tuple
    members: list[Member] = field(default_factory=list)
    exchange: Exchange = field(default_factory=Exchange)
    k: int = 0  # rows each rank contributes per matrix (equal on every rank, zero-padded)
    cols: int = 0  # columns each rank contributes per matrix (zero-padded)
    local_rows: int = 0  # this rank's rows per matrix
    local_cols: int = 0
    # global scope: rows held by each row block (to mask padding), and this rank's row block
    block_rows: tuple[int, ...] = ()
    row_block: int = 0
    col_blocks: int = 1
    global_k: int = 0
    # across HSDP replicas: the split of the owned batch over them (None: every replica
    # orthogonalizes all of it, which is right when they hold the same momentum)
    replicas: ReplicaSplit | None = None

    @property
    def moves_data(self) -> bool:
        """Whether the packed rows leave this rank (to their owner, or to share with replicas)."""
        return self.exchange.moves_data or self.replicas is not None

    @property
    def sends_ns_input(self) -> bool:
        """Whether the rows that leave this rank go as Newton-Schulz's input (normalized by the
        whole matrix's norm, in the NS dtype: half the bytes of float32): wherever they move,
        except to replicas that average them first (compressed sync averages the momentum, in
        its dtype)."""
        return self.moves_data and (self.replicas is None or not self.replicas.mean)

    @property
    def batch(self) -> int:
        return sum(m.layout.batch for m in self.members)

    @property
    def selected(self) -> int:
        """Rows this rank actually selects per matrix (the rest of ``k`` is padding)."""
        return min(self.k, self.local_rows)


def rows_to_select(fraction: float, rows: int) -> int:
    """k = ceil(f * rows), at least one row when there are any."""
    if rows == 0:
        return 0
    return min(rows, max(1, math.ceil(fraction * rows - 1e-9)))


def block_k(fraction: float, scope: str, global_rows: int, max_rows: int) -> int:
    """Rows every rank of a gather group contributes per matrix (zero-padded): k of the
    group's largest shard ("local" scope), or the whole matrix's k capped by that shard
    ("global")."""
    if scope == "global":
        return min(rows_to_select(fraction, global_rows), max_rows)
    return rows_to_select(fraction, max_rows)


def assign_owners(load: list[float], count: int, rows: int, cols: int, h: PlanSettings) -> list[int]:
    """Owners of ``count`` matrices of one shape group, gathered at ``rows`` x ``cols``: each
    goes to the least-loaded rank of the gather group (the lowest among equals). ``load``
    (NS FLOPs per group rank) is shared by the shape groups of one process group, taken in
    group order, and updated in place. Each matrix costs its NS FLOPs, symmetric products at
    half cost."""
    cost = ns_flops(rows, cols, h.ns_algorithm, h.ns_steps, h.ns_restarts, symmetric=True)
    owners = []
    for _ in range(count):
        q = min(range(len(load)), key=lambda r: (load[r], r))
        load[q] += cost
        owners.append(q)
    return owners


def group_key(group_index: int, layout: MatrixLayout, dtype: torch.dtype) -> tuple:
    """Same full shape, dtype and sharding (hence the same local shape on a rank): one batch.
    Nothing rank-dependent enters the key, so every rank forms the same groups in the same order."""
    mesh_id = None if layout.mesh is None else tuple(layout.mesh.mesh.flatten().tolist())
    return (
        group_index,
        layout.global_shape[-2:],
        layout.row_dim,
        dtype,
        mesh_id,
        tuple((s.tensor_dim, s.mesh_dim) for s in layout.matrix_shards()),
        tuple(s.mesh_dim for s in layout.replicas),
        layout.row_counts,  # pieces of one shape can be cut differently by the shards
    )


_flat_groups: dict[tuple, tuple] = {}


def _gather_group(layout: MatrixLayout):
    """(process group, my rank in it, row block of each group rank, column block of each)."""
    dims = sorted(layout.matrix_shards(), key=lambda d: d.mesh_dim)
    mesh = layout.mesh
    sizes = [d.size for d in dims]
    if len(dims) == 1:
        group, rank = mesh.get_group(dims[0].mesh_dim), dims[0].rank
    else:
        key = (tuple(mesh.mesh.flatten().tolist()), tuple(d.mesh_dim for d in dims))
        if key not in _flat_groups:
            names = mesh.mesh_dim_names
            if names is None:
                raise ValueError("Dion3 needs named mesh dims to shard a matrix over several mesh dims")
            flat = mesh[tuple(names[d.mesh_dim] for d in dims)]._flatten()
            _flat_groups[key] = (flat.get_group(), flat.get_local_rank())
        group, rank = _flat_groups[key]
    row_block, col_block = [], []
    for g in range(math.prod(sizes)):
        coords, rest = [], g
        for s in reversed(sizes):
            coords.append(rest % s)
            rest //= s
        coords.reverse()
        rb = cb = 0
        for d, c in zip(dims, coords):
            if d.tensor_dim == layout.row_dim:
                rb = rb * d.size + c
            else:
                cb = cb * d.size + c
        row_block.append(rb)
        col_block.append(cb)
    return group, rank, row_block, col_block


def _all_gather_ints(values: list[int], group, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return torch.stack(out).cpu()


def build_groups(entries: list[PlanEntry], settings: list[PlanSettings | None], stats: CommStats) -> list[ShapeGroup]:
    """The shape groups of ``entries``; ``settings[i]``: param group i's (None for a group
    without matrices). Collective over the ranks of each gather group."""
    groups: dict[tuple, ShapeGroup] = {}
    for e in entries:
        key = group_key(e.group_index, e.layout, e.param.dtype)
        g = groups.setdefault(key, ShapeGroup(e.group_index, key))
        name = e.name if e.piece_index is None else f"{e.name}[{e.piece_index}]"
        g.members.append(Member(e.param, name, e.layout, e.lr_scale, piece_index=e.piece_index))
    planned = []
    for g in groups.values():
        planned.extend([g] if settings[g.group_index].megabatch else _per_shard_batches(g))
    loads: dict[int, list[float]] = {}
    for g in planned:
        offset = 0
        for m in g.members:
            m.offset = offset
            offset += m.layout.batch
        _plan_group(g, settings[g.group_index], stats, loads)
    return planned


def _per_shard_batches(g: ShapeGroup) -> list[ShapeGroup]:
    """Without megabatching: consecutive batches of (about) as many matrices as shards."""
    shards = math.prod(s.size for s in g.members[0].layout.matrix_shards())
    out: list[ShapeGroup] = []
    for m in g.members:
        if not out or sum(x.layout.batch for x in out[-1].members) + m.layout.batch > shards:
            out.append(ShapeGroup(g.group_index, (*g.key, len(out))))
        out[-1].members.append(m)
    return out


def _plan_group(g: ShapeGroup, h: PlanSettings, stats: CommStats, loads: dict) -> None:
    lay = g.members[0].layout
    g.local_rows, g.local_cols = lay.local_rows, lay.local_cols
    fraction, scope = h.fraction, h.selection_scope
    device = g.members[0].param.device
    replicas = [r for r in lay.replicas if r.size > 1] if dist.is_initialized() else []
    compressed = h.replicate_sync == "compressed"
    if not lay.matrix_shards():
        g.k = rows_to_select(fraction, g.local_rows)
        g.cols = g.local_cols
        g.block_rows, g.global_k = (g.local_rows,), g.k
        if replicas and compressed:
            g.replicas = _replica_split(lay, replicas, g.batch, True, stats)
        elif replicas:  # replicated whole (DDP): each replica orthogonalizes its share
            r = replicas[0]
            owners = [j % r.size for j in range(g.batch)]
            g.exchange = ReplicatedExchange(lay.mesh.get_group(r.mesh_dim), r.rank, r.size, owners, stats)
        return
    group, rank, row_block, col_block = _gather_group(lay)
    shapes = _all_gather_ints([g.local_rows, g.local_cols], group, device if device.type != "meta" else "cpu")
    n_rb = max(row_block) + 1
    g.block_rows = tuple(int(shapes[row_block.index(b), 0]) for b in range(n_rb))
    g.row_block, g.col_blocks = row_block[rank], max(col_block) + 1
    max_rows, g.cols = int(shapes[:, 0].max()), int(shapes[:, 1].max())
    g.global_k = rows_to_select(fraction, lay.global_rows)
    g.k = block_k(fraction, scope, lay.global_rows, max_rows)
    load = loads.setdefault(id(group), [0.0] * len(row_block))
    owners = assign_owners(load, g.batch, n_rb * g.k, g.col_blocks * g.cols, h)
    g.exchange = ShardedExchange(group, rank, row_block, col_block, owners, g.k, g.cols, stats)
    if replicas and (compressed or h.replicate_ns == "split"):
        g.replicas = _replica_split(lay, replicas, g.exchange.n_own, compressed, stats)


def _replica_split(lay: MatrixLayout, replicas: list, n: int, mean: bool, stats: CommStats) -> ReplicaSplit:
    if len(replicas) > 1:
        raise ValueError(
            f"a parameter of shape {lay.global_shape} is replicated over {len(replicas)} mesh dims; splitting "
            "across replicas (replicate_sync='compressed' or replicate_ns='split') takes one replicate dim"
        )
    r = replicas[0]
    return ReplicaSplit(lay.mesh.get_group(r.mesh_dim), r.rank, r.size, n, mean, stats)
