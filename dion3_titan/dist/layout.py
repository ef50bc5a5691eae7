"""The DTensor boundary: how each matrix parameter is laid out and how to view its local shard.

Everything past this module works on plain local tensors of shape (B, R, C): B matrices of R
rows (the dimension rows are selected along) by C columns.
"""

from dataclasses import dataclass, field

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = ()  # type: ignore[assignment]


def is_dtensor(t: torch.Tensor) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def to_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


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

    @property
    def col_dim(self) -> int:
        return -1 if self.row_dim == -2 else -2

    def matrix_shards(self) -> tuple[MeshDim, ...]:
        """Mesh dims that cut the matrices themselves (not just the batch of experts)."""
        return tuple(s for s in self.shards if s.tensor_dim in (-2, -1))


def _choose_row_dim(global_shape: tuple[int, ...], sharded_matrix_dims: set[int], selection_dim: str) -> int:
    if selection_dim == "rows":
        return -2
    if selection_dim == "cols":
        return -1
    # "auto": select along the dim a shard cuts (its rows stay whole locally); else the smaller.
    if -2 in sharded_matrix_dims:
        return -2
    if -1 in sharded_matrix_dims:
        return -1
    return -2 if global_shape[-2] <= global_shape[-1] else -1


def describe(param: torch.Tensor, selection_dim: str) -> MatrixLayout:
    """Read a parameter's DTensor mesh and placements (or a plain tensor) into a layout."""
    if param.ndim not in (2, 3):
        raise ValueError(f"a Dion3 parameter must be 2D or 3D, got shape {tuple(param.shape)}")
    global_shape = tuple(param.shape)
    if not is_dtensor(param):
        row_dim = _choose_row_dim(global_shape, set(), selection_dim)
        return MatrixLayout(global_shape, global_shape, row_dim)
    mesh = param.device_mesh
    shards, replicas = [], []
    for mesh_dim, placement in enumerate(param.placements):
        size = mesh.size(mesh_dim)
        rank = mesh.get_local_rank(mesh_dim)
        if isinstance(placement, Shard):  # _StridedShard too: which rows are local is all we need
            shards.append(MeshDim(placement.dim - param.ndim, mesh_dim, size, rank))
        elif isinstance(placement, Replicate):
            replicas.append(MeshDim(0, mesh_dim, size, rank))
        else:
            raise ValueError(
                f"unsupported placement {placement} for a Dion3 parameter of shape {global_shape}: "
                "Dion3 handles Shard and Replicate"
            )
    local_shape = tuple(param.to_local().shape)
    matrix_dims = {s.tensor_dim for s in shards if s.tensor_dim >= -2}
    row_dim = _choose_row_dim(global_shape, matrix_dims, selection_dim)
    return MatrixLayout(global_shape, local_shape, row_dim, tuple(shards), tuple(replicas), mesh)


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
        if isinstance(placement, Shard):
            dim = placement.dim - param.ndim
            if dim == layout.row_dim:
                new_dim = ndim - 1
            elif dim < -2:
                new_dim = dim + 1 + ndim  # a batch dim keeps its position
            else:
                placements.append(Replicate())
                continue
            if type(placement).__name__ == "_StridedShard":
                placements.append(type(placement)(new_dim, split_factor=placement.split_factor))
            else:
                placements.append(Shard(new_dim))
        else:
            placements.append(Replicate())
    global_shape = (*layout.global_shape[:-2], layout.global_rows)
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(zeros, param.device_mesh, placements, shape=global_shape, stride=stride)
