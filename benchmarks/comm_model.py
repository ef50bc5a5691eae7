"""A model of one training step's collectives beyond one GPU, rank by rank, without running it.

Given the routed parameters (benchmarks/comm_params.py), a mesh (R replicas x S shards on nodes
of G GPUs; global rank = replica * S + shard, torchtitan's mesh order) and the optimizer's
settings, it lists for every rank each collective of one step with the bytes the rank receives
from other ranks: FSDP2's parameter all-gathers and gradient reduce-scatter / all-reduce, the
optimizer's own collectives (what ``Dion3.comm_stats`` counts), and the scalar all-reduces.
The collectives follow the protocol of the replicate sync modes (docs/distributed.md, "Across
nodes"); the plan's rules and byte formulas are the package's own (dist/plan.py, dist/comm.py,
kernels/flops.py), called here, never restated.

Physical links. A collective over a group inside one node is all intra-node (NVLink). For a
group spanning nodes: an all-to-all receives each peer's bytes over the link to that peer (its
node or another); a ring collective (all-gather, reduce-scatter, all-reduce) is taken as
hierarchical (inside each node, then across nodes among ranks of equal local index), so of the
ring's (|G| - 1) chunks a rank receives, (nodes spanned - 1) come across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.comm_params import Param
from benchmarks.comm_plan import GroupPlan, Mesh, build_plan, every_row, local_chunk, result_scalars
from dion3_titan.dist.comm import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    extra_columns,
    reduce_scatter_bytes,
)
from dion3_titan.kernels.flops import ns_flops
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.flavors import FLAVORS

SYNC_MODES = ("gradients", "compressed")
REPLICATE_NS = ("repeat", "split")
FP32 = 4  # FSDP2's reduce dtype (torchtitan), row scores, and the scalar flags


@dataclass(frozen=True)
class Sync:
    mode: str = "gradients"  # replicate_sync
    replicate_ns: str = "repeat"  # gradients mode: "split" shares an owner's NS over replicas

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES or self.replicate_ns not in REPLICATE_NS:
            raise ValueError(f"sync {self}: mode in {SYNC_MODES}, replicate_ns in {REPLICATE_NS}")

    @property
    def splits_ns(self) -> bool:
        return self.mode == "compressed" or self.replicate_ns == "split"

    def label(self) -> str:
        return "compressed" if self.mode == "compressed" else f"gradients/{self.replicate_ns}"


@dataclass
class Transfer:
    """One kind of collective in one rank's step, all its calls together: the bytes the rank
    receives from the other ranks of ``group``."""

    phase: str  # "fsdp" (FSDP2), "optimizer" (what Dion3.comm_stats counts), "scalars"
    name: str
    link: str  # "shard" | "replicate" | "world": the mesh group
    group: tuple[int, ...]
    nbytes: int = 0
    calls: int = 0
    from_peer: dict[int, int] | None = None  # all-to-all: bytes from each peer
    intra: int = 0  # of nbytes, over this node's links
    inter: int = 0  # across nodes


@dataclass
class RankStep:
    rank: int
    transfers: list[Transfer] = field(default_factory=list)
    ns_flops: float = 0.0

    def by_link(self, phase: str = "optimizer") -> dict[str, int]:
        """Bytes per mesh link of one phase (the optimizer's: what comm_stats.by_link counts)."""
        out: dict[str, int] = {}
        for t in self.transfers:
            if t.phase == phase:
                out[t.link] = out.get(t.link, 0) + t.nbytes
        return out

    def calls(self, phase: str = "optimizer") -> int:
        return sum(t.calls for t in self.transfers if t.phase == phase)


# ----------------------------------------------------------------------------- one rank's step
class _Recorder:
    """Collects one rank's transfers, one per (phase, name, link)."""

    def __init__(self, mesh: Mesh, rank: int) -> None:
        self.mesh, self.rank = mesh, rank
        self.step = RankStep(rank)
        self._index: dict[tuple[str, str, str], Transfer] = {}

    def _transfer(self, phase: str, name: str, link: str, peers: bool) -> Transfer:
        key = (phase, name, link)
        if key not in self._index:
            mesh = self.mesh
            group = {
                "shard": mesh.shard_group(self.rank),
                "replicate": mesh.replicate_group(self.rank),
            }.get(link, tuple(range(mesh.world)))
            self._index[key] = Transfer(phase, name, link, group, from_peer={} if peers else None)
            self.step.transfers.append(self._index[key])
        return self._index[key]

    def ring(self, phase: str, name: str, link: str, nbytes: int) -> None:
        t = self._transfer(phase, name, link, peers=False)
        if len(t.group) > 1:
            t.nbytes += int(nbytes)
            t.calls += 1

    def all_to_all(self, phase: str, name: str, recv: list[int], element_size: int) -> None:
        """``recv``: elements received from each shard-group rank (its own block included)."""
        t = self._transfer(phase, name, "shard", peers=True)
        me = self.rank % self.mesh.shards
        for i, n in enumerate(recv):
            if i != me:
                t.from_peer[t.group[i]] = t.from_peer.get(t.group[i], 0) + n * element_size
        t.nbytes += all_to_all_bytes(recv, me, element_size)
        t.calls += 1


def _optimizer(rec: _Recorder, plans: list[GroupPlan], cfg: Dion3Config, sync: Sync, params: list[Param]) -> None:
    mesh, (r, s) = rec.mesh, rec.mesh.coords(rec.rank)
    R = mesh.replicas
    ns = cfg.compute_dtype.itemsize  # results travel as Newton-Schulz returns them
    row_data = FLAVORS[cfg.flavor].row_data
    extra = result_scalars(cfg) * extra_columns(cfg.compute_dtype)  # columns beside a result row
    compressed = sync.mode == "compressed"
    # l1 scores: one collective per step for all shape groups (optim/selection.py RowSelector.scores)
    scored = [g for g in plans if not every_row(g, s, cfg)] if cfg.selection == "l1" else []
    if compressed and scored:  # the replicas agree on the scores
        numel = sum(g.batch[s] * g.layouts[s].local_rows for g in scored)
        rec.ring("optimizer", "scores all-reduce", "replicate", all_reduce_bytes(numel, R, FP32))
    tabled = [g for g in scored if g.sharded and (g.n_cb > 1 or (cfg.selection_scope == "global" and g.n_rb > 1))]
    if tabled:  # the shards' partial scores, or every row block's
        numel = sum(g.batch[s] * max(g.block_rows) for g in tabled)
        rec.ring("optimizer", "scores all-gather", "shard", all_gather_bytes(numel, mesh.shards, FP32))
    sharded = [g for g in plans if g.sharded]
    if sharded and not compressed:  # the norms that the rows are normalized by before they move
        numel = sum(g.batch[s] for g in sharded)
        rec.ring("optimizer", "row norms all-reduce", "shard", all_reduce_bytes(numel, mesh.shards, FP32))
    for g in plans:
        k, n = g.k[s], g.batch[s]
        mom = g.dtype.itemsize  # momentum rows travel in the momentum's (the parameter's) dtype
        # sharded rows travel as NS's input, unless the replicas average them (compressed sync)
        wire = cfg.compute_dtype if not compressed else g.dtype
        if not g.sharded:  # whole on every shard rank
            if compressed:
                _replica_split(rec, n, k * g.cols[s], r, mom, ns)
                rec.step.ns_flops += _share(n, R, r) * _cost(k, g.cols[s], cfg)
            else:  # round-robin over the replicas (ReplicatedExchange), results all-gathered
                share = -(-n // R)
                rec.ring(
                    "optimizer",
                    "results all-gather",
                    "replicate",
                    all_gather_bytes(share * k * (g.cols[s] + extra), R, ns),
                )
                rec.step.ns_flops += (share if R > 1 else n) * _cost(k, g.cols[s], cfg)
            continue
        block = k * (g.cols[s] + extra)  # a result block
        sent = k * (g.cols[s] + (extra_columns(wire) if row_data else 0))
        counts = [g.owners.count(q) for q in range(mesh.shards)]
        rec.all_to_all("optimizer", "rows gather (all-to-all)", [counts[s] * sent] * mesh.shards, wire.itemsize)
        own = counts[s]
        per = g.n_rb * k * g.n_cb * g.cols[s]  # one gathered matrix
        if sync.splits_ns and R > 1:
            _replica_split(rec, own, per, r, mom if compressed else 0, ns)
            own = _share(own, R, r)
        rec.all_to_all("optimizer", "results scatter (all-to-all)", [c * block for c in counts], ns)
        rec.step.ns_flops += own * _cost(g.n_rb * k, g.n_cb * g.cols[s], cfg)
    if compressed:
        numel = sum(_local_numel(p, mesh, s) for p in params if not p.matrix)
        rec.ring("optimizer", "AdamW gradient all-reduce", "replicate", all_reduce_bytes(numel, R, FP32))


def _share(n: int, replicas: int, r: int) -> int:
    """Matrices replica ``r`` orthogonalizes of an owned batch of ``n`` (dist/replicas.py)."""
    return (r + 1) * n // replicas - r * n // replicas


def _replica_split(rec: _Recorder, n: int, per: int, r: int, mean_bytes: int, result_bytes: int) -> None:
    """ReplicaSplit of an owned batch of ``n`` matrices of ``per`` elements: under compressed
    sync (``mean_bytes`` > 0) every replica receives the others' copies of its share; then every
    replica receives the others' shares of the results. Exact splits, no padding."""
    R = rec.mesh.replicas
    own = _share(n, R, r)
    if mean_bytes:
        rec.ring("optimizer", "momentum mean (all-to-all)", "replicate", (R - 1) * own * per * mean_bytes)
    rec.ring("optimizer", "results all-gather (all-to-all)", "replicate", (n - own) * per * result_bytes)


def _cost(rows: int, cols: int, cfg: Dion3Config) -> float:
    """NS FLOPs of one matrix (symmetric products at half cost: the GPU backends' kernels)."""
    if rows == 0 or cols == 0:
        return 0.0
    return ns_flops(rows, cols, cfg.ns_algorithm, cfg.ns_steps, cfg.ns_restarts, symmetric=True)


def _local_numel(p: Param, mesh: Mesh, shard: int) -> int:
    return local_chunk(p.shape[0], mesh.shards, shard)[0] * (p.numel // p.shape[0])


def _fsdp(rec: _Recorder, params: list[Param], sync: Sync, param_bytes: int) -> None:
    """FSDP2 on every parameter, Shard(0) padded to equal chunks: all-gathers of the
    parameters (``param_bytes``: its mixed-precision param dtype), the gradient reduce-scatter
    (fp32) and, in gradients mode, the all-reduce of the gradient shard across replicas. Per
    parameter: FSDP2 batches a unit's parameters into one call, which changes only the
    ring's rounding."""
    S, R = rec.mesh.shards, rec.mesh.replicas
    for p in params:
        padded = -(-p.shape[0] // S) * (p.numel // p.shape[0])  # one rank's shard, padded
        rec.ring("fsdp", "param all-gather", "shard", p.gathers * all_gather_bytes(padded, S, param_bytes))
        rec.ring("fsdp", "grad reduce-scatter", "shard", reduce_scatter_bytes(padded, S, FP32))
        if sync.mode == "gradients":
            rec.ring("fsdp", "grad all-reduce", "replicate", all_reduce_bytes(padded, R, FP32))


def _scalars(rec: _Recorder, sync: Sync) -> None:
    """One float each: the optimizer's finite-gradient flag (all ranks) and the gradient norm
    of clipping (the shard group; across replicas too when their gradients differ)."""
    mesh = rec.mesh
    rec.ring("scalars", "finite flag all-reduce", "world", all_reduce_bytes(1, mesh.world, FP32))
    rec.ring("scalars", "grad-norm all-reduce", "shard", all_reduce_bytes(1, mesh.shards, FP32))
    if sync.mode == "compressed":
        rec.ring("scalars", "grad-norm all-reduce", "replicate", all_reduce_bytes(1, mesh.replicas, FP32))


def _split_links(t: Transfer, mesh: Mesh, rank: int) -> None:
    """Fill ``t.intra`` / ``t.inter`` (the module docstring gives the rule)."""
    node = mesh.node(rank)
    if t.from_peer is not None:
        t.inter = sum(b for peer, b in t.from_peer.items() if mesh.node(peer) != node)
    else:
        per_node: dict[int, int] = {}
        for r in t.group:
            per_node[mesh.node(r)] = per_node.get(mesh.node(r), 0) + 1
        if len(set(per_node.values())) != 1:
            raise ValueError(f"group {t.group} holds unequal numbers of ranks per node")
        t.inter = t.nbytes * (len(per_node) - 1) // (len(t.group) - 1)
    t.intra = t.nbytes - t.inter


def model_step(params: list[Param], cfg: Dion3Config, mesh: Mesh, sync: Sync, param_bytes: int = 2) -> list[RankStep]:
    """Every rank's collectives and NS FLOPs of one step."""
    plans = build_plan(params, cfg, mesh)
    out = []
    for rank in range(mesh.world):
        rec = _Recorder(mesh, rank)
        _fsdp(rec, params, sync, param_bytes)
        _optimizer(rec, plans, cfg, sync, params)
        _scalars(rec, sync)
        rec.step.transfers = [t for t in rec.step.transfers if t.calls]
        for t in rec.step.transfers:
            _split_links(t, mesh, rank)
        out.append(rec.step)
    return out
