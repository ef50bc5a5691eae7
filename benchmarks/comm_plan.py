"""The comm model's view of the megabatch plan: the layouts ``dist/layout.describe`` gives each
matrix under FSDP2's Shard(0) on every shard coordinate of a mesh, and the shape groups, k,
padded columns and owners ``dist/plan.build_groups`` forms from them, computed with the plan's
own rules (group_key, block_k, assign_owners) instead of a process group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Shard

from benchmarks.comm_params import Param
from dion3_titan.dist.layout import ROW_DIMS, MatrixLayout, MeshDim, normalize_piece
from dion3_titan.dist.plan import assign_owners, block_k, group_key, rows_to_select
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.dion3 import plan_settings
from dion3_titan.optim.flavors import FLAVORS


@dataclass(frozen=True)
class Mesh:
    """R replicas x S shards on nodes of G GPUs; global rank = replica * S + shard (torchtitan's
    mesh order), node = rank // G."""

    replicas: int  # R (HSDP data_parallel_replicate_degree; 1 for FSDP)
    shards: int  # S (data_parallel_shard_degree)
    gpus_per_node: int

    def __post_init__(self) -> None:
        g, s = self.gpus_per_node, self.shards
        if min(self.replicas, s, g) < 1 or self.world % g or (s % g and g % s):
            raise ValueError(f"mesh {self}: the ranks must fill whole nodes and S divide G or G divide S")

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    def coords(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.shards)  # (replica, shard)

    def shard_group(self, rank: int) -> tuple[int, ...]:
        q = rank // self.shards
        return tuple(q * self.shards + s for s in range(self.shards))

    def replicate_group(self, rank: int) -> tuple[int, ...]:
        s = rank % self.shards
        return tuple(q * self.shards + s for q in range(self.replicas))

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


# ----------------------------------------------------------------------------- layouts
def local_chunk(size: int, chunks: int, index: int) -> tuple[int, int]:
    """(length, offset) of chunk ``index`` of dim ``size`` cut ``chunks`` ways (torch.chunk)."""
    return Shard.local_shard_size_and_offset(size, chunks, index)


def _rows_in(piece: slice, start: int, stop: int) -> int:
    """Rows of ``piece`` (normalized, step >= 1) inside [start, stop)."""

    def first_at(x: int) -> int:  # index in the piece of its first row >= x
        return max(0, -(-(x - piece.start) // piece.step))

    n = len(range(piece.start, piece.stop, piece.step))
    return max(0, min(n, first_at(stop)) - min(n, first_at(start)))


def layout(p: Param, piece: slice | None, mesh: Mesh, shard: int, row_dim: int) -> MatrixLayout:
    """The MatrixLayout ``dist/layout.describe`` gives parameter ``p`` (or its ``piece``) on
    shard coordinate ``shard`` under FSDP2's Shard(0) (and Replicate over the replicas)."""
    shape, S = p.shape, mesh.shards
    hsdp = mesh.replicas > 1
    n0, off = local_chunk(shape[0], S, shard)
    local = (n0, *shape[1:])
    shard_dim = MeshDim(-len(shape), 1 if hsdp else 0, S, shard)
    replicas = (MeshDim(0, 0, mesh.replicas, 0),) if hsdp else ()
    rows_cut = len(shape) == 2  # Shard(0) of a matrix cuts its rows; of a stack, its experts
    if piece is None:
        counts = tuple(local_chunk(shape[0], S, c)[0] for c in range(S)) if rows_cut else ()
        return MatrixLayout(shape, local, row_dim, (shard_dim,), replicas, row_counts=counts)
    piece = normalize_piece(piece, shape[-2])
    n = len(range(piece.start, piece.stop, piece.step))
    if rows_cut:
        bounds = [local_chunk(shape[0], S, c) for c in range(S)]
        counts = tuple(_rows_in(piece, o, o + m) for m, o in bounds)
        local_rows = _rows_in(piece, off, off + n0)
    else:
        counts, local_rows = (), n
    return MatrixLayout(
        (*shape[:-2], n, shape[-1]),
        (*local[:-2], local_rows, local[-1]),
        row_dim,
        (shard_dim,),
        replicas,
        piece=piece,
        row_counts=counts,
    )


# ----------------------------------------------------------------------------- the plan
@dataclass
class GroupPlan:
    """One shape group of the megabatch plan, for every shard coordinate."""

    key: tuple
    dtype: torch.dtype  # the members' (their momentum's too)
    sharded: bool  # cut by the shard dim: gathered to owners (else whole on every rank)
    layouts: list[MatrixLayout]  # member 0's, per shard coordinate
    batch: list[int]  # matrices per shard coordinate
    k: list[int]  # rows contributed per matrix, per shard coordinate (equal when sharded)
    cols: list[int]
    n_rb: int = 1
    n_cb: int = 1
    block_rows: tuple[int, ...] = ()
    global_k: int = 0
    owners: list[int] = field(default_factory=list)  # sharded: shard rank of each matrix


def build_plan(params: list[Param], cfg: Dion3Config, mesh: Mesh) -> list[GroupPlan]:
    """The shape groups dist/plan.build_groups forms from ``params`` (one matrix param group),
    in its order, with its k, padded cols and owners."""
    if not cfg.megabatch:
        raise ValueError("the comm model plans megabatched groups only (megabatch = true)")
    row_dim, settings = ROW_DIMS[cfg.selection_dim], plan_settings(cfg)
    groups: dict[tuple, tuple[torch.dtype, list[list[MatrixLayout]]]] = {}
    for p in (p for p in params if p.matrix):
        for piece in p.pieces or (None,):
            lays = [layout(p, piece, mesh, s, row_dim) for s in range(mesh.shards)]
            groups.setdefault(group_key(0, lays[0], p.dtype), (p.dtype, []))[1].append(lays)
    plans, load = [], [0.0] * mesh.shards  # one gather group (the shard dim) for every group
    for key, (dtype, members) in groups.items():
        lays = members[0]
        batch = [sum(m[s].batch for m in members) for s in range(mesh.shards)]
        if not lays[0].matrix_shards():
            k = [rows_to_select(cfg.fraction, lay.local_rows) for lay in lays]
            plans.append(GroupPlan(key, dtype, False, lays, batch, k, [lay.local_cols for lay in lays]))
            continue
        cuts_rows = lays[0].matrix_shards()[0].tensor_dim == row_dim
        n_rb, n_cb = (mesh.shards, 1) if cuts_rows else (1, mesh.shards)
        block_rows = tuple(lay.local_rows for lay in lays) if cuts_rows else (lays[0].local_rows,)
        max_rows, cols = max(lay.local_rows for lay in lays), max(lay.local_cols for lay in lays)
        k = block_k(cfg.fraction, cfg.selection_scope, lays[0].global_rows, max_rows)
        owners = assign_owners(load, batch[0], n_rb * k, n_cb * cols, settings)
        global_k = rows_to_select(cfg.fraction, lays[0].global_rows)
        sharded = GroupPlan(key, dtype, True, lays, batch, [k] * mesh.shards, [cols] * mesh.shards)
        sharded.n_rb, sharded.n_cb, sharded.block_rows, sharded.global_k, sharded.owners = (
            n_rb,
            n_cb,
            block_rows,
            global_k,
            owners,
        )
        plans.append(sharded)
    return plans


def result_scalars(cfg: Dion3Config) -> int:
    """The float32 scalars an owner sends back beside each row of an NS result (which goes in
    the NS dtype): the flavor's per-row data and the factors of its normalization (Muon: none;
    NorMuon: its second moment, the row's denominator, the matrix's scale)."""
    flavor = FLAVORS[cfg.flavor]
    ortho = torch.ones(1, 1, 1, dtype=cfg.compute_dtype)
    data = torch.ones(1, 1) if flavor.row_data else None
    return sum(t is not None for t in flavor.factors(ortho, data, cfg, 1))


def every_row(g: GroupPlan, shard: int, cfg: Dion3Config) -> bool:
    """Selection picks every local row (Dion3._every_row): no scores are formed or shared."""
    rows = g.layouts[shard].local_rows
    if min(g.k[shard], rows) < rows:
        return False
    return not g.sharded or cfg.selection_scope == "local" or g.global_k >= sum(g.block_rows)
