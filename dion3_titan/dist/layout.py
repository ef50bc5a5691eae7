"""The DTensor boundary: how each matrix parameter is laid out and how to view its local shard.

Everything past this module works on plain local tensors of shape (B, R, C): B matrices of R
rows (the dimension rows are selected along) by C columns.
"""

import itertools
from dataclasses import dataclass, field
from functools import lru_cache

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = ()  # type: ignore[assignment]


def is_dtensor(t: torch.Tensor) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def _is_strided_shard(placement) -> bool:
    """torch's private _StridedShard (FSDP2 over TP), recognised by its type name: the class is
    private, moves between torch releases and is not a Shard subclass in recent ones."""
    return type(placement).__name__ == "_StridedShard"


def _is_shard(placement) -> bool:
    """Shard or _StridedShard."""
    return isinstance(placement, Shard) or _is_strided_shard(placement)


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor behind a parameter, gradient or state tensor: a DTensor's shard,
    and inside it the tensor a wrapper subclass holds (torchao's float8 training weights wrap
    their high-precision weight), so kernels see real storage and in-place updates land in
    the parameter."""
    if is_dtensor(t):
        t = t.to_local()
    return _unwrapped(t)


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, n) for n in names]
    same = [x for x in inner if x.shape == t.shape and x.dtype == t.dtype]
    if len(same) != 1:
        raise TypeError(
            f"dion3: parameter of tensor subclass {type(t).__name__} does not wrap exactly one tensor of its "
            "own shape and dtype; the optimizer cannot update it in place"
        )
    return _unwrapped(same[0])


@dataclass(frozen=True)
class MeshDim:
    """One mesh dimension that shards the matrix: which tensor dim it cuts and its group."""

    tensor_dim: int  # dim of the parameter (negative: -2 rows of W, -1 columns, else batch)
    mesh_dim: int  # index of this dimension in the parameter's device mesh
    size: int
    rank: int


@dataclass(frozen=True)
class MatrixLayout:
    """Layout of one matrix (or stack of matrices) parameter."""

    global_shape: tuple[int, ...]  # full parameter shape (batch dims..., d_out, d_in)
    local_shape: tuple[int, ...]
    row_dim: int  # -2 (select rows of W) or -1 (select columns of W)
    shards: tuple[MeshDim, ...] = field(default_factory=tuple)  # dims that cut the tensor
    replicas: tuple[MeshDim, ...] = field(default_factory=tuple)  # Replicate mesh dims
    mesh: object = None  # the DeviceMesh (None for a plain tensor)
    # A piece (optim/split.py): this layout then describes the row slice ``piece`` (dim -2) of
    # the parameter; ``local_piece`` is where the piece's rows sit in the local shard (a view).
    piece: slice | None = field(default=None, hash=False)  # (slices are unhashable before 3.12)
    local_piece: slice | None = field(default=None, hash=False)
    # Rows of dim -2 held by each coordinate of the mesh dims that cut dim -2 (row-major over
    # those dims; () when dim -2 is whole on every rank). Rank-independent: part of the group key.
    row_counts: tuple[int, ...] = ()

    @property
    def d_out(self) -> int:
        return self.global_shape[-2]

    @property
    def d_in(self) -> int:
        return self.global_shape[-1]

    @property
    def batch(self) -> int:
        """Local number of matrices."""
        b = 1
        for s in self.local_shape[:-2]:
            b *= s
        return b

    @property
    def global_rows(self) -> int:
        return self.global_shape[self.row_dim]

    @property
    def global_cols(self) -> int:
        return self.global_shape[-1 if self.row_dim == -2 else -2]

    @property
    def local_rows(self) -> int:
        return self.local_shape[self.row_dim]

    @property
    def local_cols(self) -> int:
        return self.local_shape[-1 if self.row_dim == -2 else -2]

    def oriented(self, local: torch.Tensor) -> torch.Tensor:
        """(B, R, C) view of a local tensor of this layout (no copy)."""
        m = local.reshape(self.batch, *local.shape[-2:]) if local.ndim != 3 else local
        return m if self.row_dim == -2 else m.mT

    def piece_view(self, local: torch.Tensor) -> torch.Tensor:
        """(B, R, C) view of this layout's matrix in a local tensor shaped like the parameter's
        shard: the piece's local rows (a strided slice of dim -2, possibly empty), oriented."""
        if self.local_piece is not None:
            local = local[..., self.local_piece, :]
        return self.oriented(local)

    @property
    def col_dim(self) -> int:
        return -1 if self.row_dim == -2 else -2

    def matrix_shards(self) -> tuple[MeshDim, ...]:
        """Mesh dims that cut the matrices themselves (not just the batch of experts)."""
        return tuple(s for s in self.shards if s.tensor_dim in (-2, -1))


# selection_dim (validated by Dion3Config) -> the dim of W that rows are selected along. Fixed
# per matrix, never taken from the sharding: FSDP on N ranks must run the algorithm of one
# process and load its state.
ROW_DIMS = {"rows": -2, "cols": -1}


def _shard_rows(placement, size: int, chunks: int, rank: int) -> torch.Tensor:
    """Indices (into a dim of ``size``) that ``placement`` keeps on ``rank`` of ``chunks``,
    as DTensor computes them (torch.chunk for Shard; _StridedShard's strided offsets)."""
    if _is_strided_shard(placement):
        try:
            from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

            n, offsets = placement._local_shard_size_and_offset(size, chunks, rank, _StridedShardOffsetMode.ALL)
        except ImportError:  # pragma: no cover - older torch
            n, offsets = placement._local_shard_size_and_offset(size, chunks, rank, return_first_offset=False)
        return torch.tensor(list(offsets)[:n], dtype=torch.long)
    n, offset = Shard.local_shard_size_and_offset(size, chunks, rank)
    return torch.arange(offset, offset + n, dtype=torch.long)


def _rows_at(rows: int, cuts: tuple, coords: tuple[int, ...]) -> torch.Tensor:
    """Global indices of dim -2 held at ``coords`` of the mesh dims ``cuts`` ((placement,
    size) in mesh-dim order) that cut dim -2: sharding applied left to right, as DTensor does."""
    index = torch.arange(rows, dtype=torch.long)
    for (placement, size), c in zip(cuts, coords):
        index = index[_shard_rows(placement, index.numel(), size, c)]
    return index


def _in_piece(index: torch.Tensor, piece: slice) -> torch.Tensor:
    return (index >= piece.start) & (index < piece.stop) & ((index - piece.start) % piece.step == 0)


@lru_cache(maxsize=None)
def _row_counts(rows: int, cuts: tuple, piece: tuple[int, int, int] | None) -> tuple[int, ...]:
    """Rows of ``piece`` (of all of dim -2 when None) held at every coordinate of ``cuts``."""
    out = []
    for coords in itertools.product(*(range(size) for _, size in cuts)):
        index = _rows_at(rows, cuts, coords)
        out.append(int(_in_piece(index, slice(*piece)).sum()) if piece else index.numel())
    return tuple(out)


def normalize_piece(piece: slice, rows: int) -> slice:
    """``piece`` as slice(start, stop, step) with step >= 1 and stop just past its last row."""
    start, stop, step = piece.indices(rows)
    if step < 1:
        raise ValueError(f"a piece must be an increasing row slice, got {piece}")
    n = len(range(start, stop, step))
    return slice(start, start + (n - 1) * step + 1 if n else start, step)


def _local_piece(index: torch.Tensor, piece: slice, name: str) -> slice:
    """Where the rows of ``piece`` sit among the local rows ``index`` (global row of each
    local row), as a slice, so that the piece's local part is a view of the shard."""
    pos = torch.nonzero(_in_piece(index, piece)).flatten().tolist()
    if not pos:
        return slice(0, 0, 1)
    step = pos[1] - pos[0] if len(pos) > 1 else 1
    if any(b - a != step for a, b in zip(pos, pos[1:])):
        raise ValueError(
            f"{name}: the rows {piece} of dim -2 are not evenly spaced in this rank's shard, so "
            "they cannot be viewed without a copy; use a sharding that keeps each piece's local "
            "rows evenly spaced (e.g. plain Shard on dim -2) or drop the split for this parameter"
        )
    return slice(pos[0], pos[-1] + 1, step)


def describe(param: torch.Tensor, selection_dim: str, piece: slice | None = None, name: str = "") -> MatrixLayout:
    """Read a parameter's DTensor mesh and placements (or a plain tensor) into a layout.

    With ``piece`` (a row slice of dim -2) the layout describes that piece as its own matrix:
    global shape (..., len(piece), d_in) and the piece's rows in this rank's shard (possibly
    none). ``selection_dim`` ("rows" or "cols") alone fixes the row dim."""
    if param.ndim not in (2, 3):
        raise ValueError(f"a Dion3 parameter must be 2D or 3D, got shape {tuple(param.shape)}")
    global_shape = tuple(param.shape)
    row_dim = ROW_DIMS[selection_dim]
    name = name or f"parameter of shape {global_shape}"
    rows = global_shape[-2]
    if piece is not None:
        piece = normalize_piece(piece, rows)
        n = len(range(piece.start, piece.stop, piece.step))
        if n == 0:
            raise ValueError(f"{name}: empty piece {piece}")
        piece_global = (*global_shape[:-2], n, global_shape[-1])
    if not is_dtensor(param):
        if piece is None:
            return MatrixLayout(global_shape, global_shape, row_dim)
        return MatrixLayout(piece_global, piece_global, row_dim, piece=piece, local_piece=piece)
    mesh = param.device_mesh
    shards, replicas = [], []
    for mesh_dim, placement in enumerate(param.placements):
        size = mesh.size(mesh_dim)
        rank = mesh.get_local_rank(mesh_dim)
        if _is_shard(placement):  # _StridedShard too: which rows are local is all we need
            shards.append(MeshDim(placement.dim - param.ndim, mesh_dim, size, rank))
        elif isinstance(placement, Replicate):
            replicas.append(MeshDim(0, mesh_dim, size, rank))
        else:
            raise ValueError(
                f"unsupported placement {placement} for a Dion3 parameter of shape {global_shape}: "
                "Dion3 handles Shard and Replicate"
            )
    local_shape = tuple(param.to_local().shape)
    cuts = tuple((param.placements[s.mesh_dim], s.size) for s in shards if s.tensor_dim == -2)
    coords = tuple(s.rank for s in shards if s.tensor_dim == -2)
    if piece is None:
        counts = _row_counts(rows, cuts, None) if cuts else ()
        return MatrixLayout(global_shape, local_shape, row_dim, tuple(shards), tuple(replicas), mesh, row_counts=counts)
    local_piece = _local_piece(_rows_at(rows, cuts, coords), piece, name)
    n_local = len(range(local_piece.start, local_piece.stop, local_piece.step))
    piece_local = (*local_shape[:-2], n_local, local_shape[-1])
    counts = _row_counts(rows, cuts, (piece.start, piece.stop, piece.step)) if cuts else ()
    return MatrixLayout(
        piece_global, piece_local, row_dim, tuple(shards), tuple(replicas), mesh,
        piece=piece, local_piece=local_piece, row_counts=counts,
    )


def zeros_like_param(param: torch.Tensor) -> torch.Tensor:
    """A zero state tensor laid out like ``param`` (a DTensor for a DTensor), always of plain
    tensors: a wrapper-subclass weight (float8 training) does not make its state a subclass."""
    local = param.to_local() if is_dtensor(param) else param
    plain = _unwrapped(local)
    if plain is local:
        return torch.zeros_like(param)
    zeros = torch.zeros_like(plain)
    if not is_dtensor(param):
        return zeros
    return DTensor.from_local(zeros, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def row_state(param: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """A float32 zero tensor with one entry per selectable row of each matrix (NorMuon's
    second moment): shape (batch dims..., rows). For a DTensor parameter it is a DTensor whose
    placements follow the parameter's (rows sharded like the rows, replicated across column
    shards), so checkpoints save, load and reshard it like the parameter."""
    local = to_local(param)
    shape = (*layout.local_shape[:-2], layout.local_rows)
    zeros = torch.zeros(shape, dtype=torch.float32, device=local.device)
    if not is_dtensor(param):
        return zeros
    ndim = len(shape)
    placements = []
    for placement in param.placements:
        if _is_shard(placement):
            dim = placement.dim - param.ndim
            if dim == layout.row_dim:
                new_dim = ndim - 1
            elif dim < -2:
                new_dim = dim + 1 + ndim  # a batch dim keeps its position
            else:
                placements.append(Replicate())
                continue
            if _is_strided_shard(placement):
                placements.append(type(placement)(new_dim, split_factor=placement.split_factor))
            else:
                placements.append(Shard(new_dim))
        else:
            placements.append(Replicate())
    global_shape = (*layout.global_shape[:-2], layout.global_rows)
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(zeros, param.device_mesh, placements, shape=global_shape, stride=stride)
