"""Across HSDP replicas, on 4 gloo ranks = 2 replicas x 2 shards (paper Sec. 7):

- ``replicate_sync = "compressed"`` (each replica its own gradients and momentum, only the mean
  of the selected rows crossing) equals ``"gradients"`` (every replica the mean gradient) to fp32
  rounding after 10 steps with random selection, for both flavors at f = 1/4 and 1, and the
  replicas' weights are bit-identical at every step;
- l1 selection under compressed sync runs with the replicas identical at every step, and every
  replica updates the top rows of the replicas' summed l1 norms;
- ``replicate_ns = "split"`` equals ``"repeat"``;
- at f = 1/4 the matrices' bytes across replicas are <= 0.3x what FSDP2's gradient all-reduce
  moves in "gradients" mode;
- the momentum average before a checkpoint changes nothing later;
- the clipping norm is the p-mean over replicas of each replica's gradient norm;
- real FSDP2 (fully_shard on the 2 x 2 mesh) with its all-reduce across replicas turned off
  (dist/fsdp.py) equals native HSDP.
"""

import pytest
import torch
import torch.nn as nn

from tests.spawn import spawn

pytestmark = pytest.mark.timeout(900)

R, S = 2, 2  # replicas x shards
SHAPES = [(24, 40), (24, 40), (40, 24), (33, 33), (3, 12, 20)]  # wide, wide, tall, square (odd), 3-D stack
ADAMW_SHAPES = [(40,), (50, 24)]  # a norm and an embedding
STEPS = 10


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))


def _grads(step: int, replica: int, shapes) -> list[torch.Tensor]:
    """Replica ``replica``'s full gradients at ``step`` (fresh per step, different per replica)."""
    g = torch.Generator().manual_seed(1000 * step + 17 * replica + 3)
    return [torch.randn(s, generator=g) for s in shapes]


def _params(mesh, shapes, seed: int):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh, [Replicate(), Shard(0)])) for s in shapes]


def _optimizer(matrices, others, options):
    from dion3_titan import Dion3

    groups = [{"params": matrices}]
    if others:
        groups.append({"params": others, "algorithm": "adamw", "lr": 0.01, "weight_decay": 0.05})
    settings = {"lr": 0.05, "ns_dtype": "float32", "weight_decay": 0.1, "backend": "torch", **options}
    return Dion3(groups, **settings)


def _set_grads(mesh, params, step, sync: str, shapes) -> None:
    """ "gradients": every rank the mean over replicas; "compressed": its replica's own."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    replica = mesh.get_local_rank(0)
    per_replica = [_grads(step, r, shapes) for r in range(R)]
    for i, p in enumerate(params):
        if sync == "gradients":
            full = sum(per_replica[r][i] for r in range(R)) / R
            p.grad = distribute_tensor(full, mesh, p.placements)
        else:
            # src_data_rank=None: this rank's own data (not rank 0's, broadcast)
            mine = distribute_tensor(per_replica[replica][i], mesh, p.placements, src_data_rank=None).to_local()
            p.grad = DTensor.from_local(mine, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _replicas_identical(mesh, tensors) -> bool:
    import torch.distributed as dist

    same = True
    for t in tensors:
        local = t.to_local().contiguous()
        gathered = [torch.empty_like(local) for _ in range(R)]
        dist.all_gather(gathered, local, group=mesh.get_group(0))
        same &= all(torch.equal(gathered[0], x) for x in gathered[1:])
    return same


def _run(mesh, options, sync, steps=STEPS, checkpoint_at=None, shapes=SHAPES, adamw=ADAMW_SHAPES):
    matrices, others = _params(mesh, shapes, 0), _params(mesh, adamw, 1)
    opt = _optimizer(matrices, others, {**options, "replicate_sync": sync})
    identical, replicate_bytes = [], []
    for step in range(steps):
        _set_grads(mesh, matrices + others, step, sync, shapes + adamw)
        opt.comm_stats.reset()
        opt.step()
        replicate_bytes.append(opt.comm_stats.by_link.get("replicate", 0))
        identical.append(_replicas_identical(mesh, matrices + others))
        if step == checkpoint_at:
            opt.state_dict()  # averages the momentum across replicas
            momenta = [opt.state[p]["momentum"] for p in matrices]
            identical[-1] &= _replicas_identical(mesh, momenta)
    weights = [p.full_tensor() for p in matrices + others]
    momentum = [opt.state[p]["momentum"].to_local().clone() for p in matrices]
    return {"weights": weights, "identical": identical, "bytes": replicate_bytes, "momentum": momentum}


def _mean_momentum(mesh, momentum):
    import torch.distributed as dist

    out = []
    for m in momentum:
        m = m.clone()
        dist.all_reduce(m, group=mesh.get_group(0))
        out.append(m / R)
    return out


CASES = [(f, flavor) for f in (0.25, 1.0) for flavor in ("muon", "normuon")]


def _equality_worker(rank, world, out):
    mesh = _mesh()
    results = {}
    for fraction, flavor in CASES:
        options = {"fraction": fraction, "flavor": flavor, "selection": "random", "seed": 7}
        grad = _run(mesh, options, "gradients")
        comp = _run(mesh, options, "compressed")
        results[(fraction, flavor)] = {
            "gradients": grad["weights"],
            "compressed": comp["weights"],
            "identical": comp["identical"],
            "momentum": (grad["momentum"], _mean_momentum(mesh, comp["momentum"])),
        }
    if rank == 0:
        torch.save(results, out)


def test_compressed_equals_gradient_sync(tmp_path):
    out = tmp_path / "r.pt"
    spawn(R * S, _equality_worker, str(out))
    results = torch.load(out)
    for case, r in results.items():
        assert all(r["identical"]), (case, r["identical"])
        for i, (a, b) in enumerate(zip(r["gradients"], r["compressed"])):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (case, i, (a - b).abs().max())
        assert not torch.equal(r["gradients"][0], _params_full(0)[0]), case  # it trained
        for i, (a, b) in enumerate(zip(*r["momentum"])):  # the replicas' mean is the synced momentum
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (case, "momentum", i, (a - b).abs().max())


def _params_full(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _l1_rows(mesh) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One compressed step with l1 selection (f = 1/4, no weight decay, momentum from zero, so
    exactly the selected weight rows change): per matrix, this rank's changed rows, and the
    top rows (as many) of the replicas' summed l1 norms and of this replica's own."""
    matrices = _params(mesh, SHAPES, 0)
    before = [p.to_local().clone() for p in matrices]
    opt = _optimizer(matrices, [], {"fraction": 0.25, "replicate_sync": "compressed", "weight_decay": 0.0})
    _set_grads(mesh, matrices, 0, "compressed", SHAPES)
    opt.step()
    shard, replica = mesh.get_local_rank(1), mesh.get_local_rank(0)
    per_replica = [_grads(0, r, SHAPES) for r in range(R)]
    out = []
    for i, (p, b) in enumerate(zip(matrices, before)):
        changed = (p.to_local() != b).any(dim=-1)
        l1 = [g[i].tensor_split(S)[shard].abs().sum(dim=-1) for g in per_replica]
        k = int(changed.sum(dim=-1).reshape(-1)[0])

        def top(scores: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(changed).scatter(-1, scores.topk(k, dim=-1).indices, True)

        out.append((changed, top(sum(l1)), top(l1[replica])))
    return out


def _variants_worker(rank, world, out):
    import torch.distributed as dist

    mesh = _mesh()
    l1 = _run(mesh, {"fraction": 0.25, "flavor": "normuon"}, "compressed")
    rows = _l1_rows(mesh)
    split = {}
    for ns in ("repeat", "split"):
        split[ns] = _run(mesh, {"fraction": 0.25, "flavor": "normuon", "replicate_ns": ns}, "gradients", steps=4)
    # bytes across replicas, matrices only: ours under compressed sync vs FSDP2's gradient all-reduce
    comp = _run(mesh, {"fraction": 0.25, "flavor": "muon"}, "compressed", steps=2, adamw=[])
    from dion3_titan.dist.comm import all_reduce_bytes

    local = [torch.empty(s).tensor_split(S)[mesh.get_local_rank(1)].numel() for s in SHAPES]
    fsdp = sum(all_reduce_bytes(n, R, 4) for n in local)
    later = {}
    for at in (None, 4):
        later[at] = _run(mesh, {"fraction": 0.25, "flavor": "normuon", "selection": "random"}, "compressed", 8, at)
    # the clipping norm of compressed sync: the p-mean over replicas of each replica's norm
    from dion3_titan.compressed import replica_norm

    p = _params(mesh, [(8, 4)], 2)[0]
    _set_grads(mesh, [p], 0, "compressed", [(8, 4)])
    own = torch.tensor(3.0 + 4.0 * mesh.get_local_rank(0))  # 3 on replica 0, 7 on replica 1
    norms = {t: float(replica_norm(own, [p], t)) for t in (2.0, 1.0, float("inf"))}
    l1["rows"] = [None] * world
    dist.all_gather_object(l1["rows"], rows)
    if rank == 0:
        torch.save(
            {"l1": l1, "split": split, "comp_bytes": comp["bytes"], "fsdp_bytes": fsdp, "later": later, "norms": norms},
            out,
        )


def test_l1_split_bytes_and_checkpoint_average(tmp_path):
    out = tmp_path / "r.pt"
    spawn(R * S, _variants_worker, str(out))
    r = torch.load(out)
    assert all(r["l1"]["identical"]), r["l1"]["identical"]
    # every replica updates the top rows of the replicas' summed l1 norms (dist/replicas.py
    # agree_scores: one all-reduce for all shape groups), not of its own
    differs = False
    for rank, matrices in enumerate(r["l1"]["rows"]):
        for i, (changed, summed, own) in enumerate(matrices):
            assert 0 < changed.sum() < changed.numel(), (rank, i)
            assert torch.equal(changed, summed), (rank, i, changed, summed)
            differs |= not torch.equal(summed, own)
    assert differs  # else the check above could not tell the agreed scores from a replica's own
    assert all(r["split"]["split"]["identical"]), r["split"]["split"]["identical"]
    # split all-gathers every group's results across replicas; repeat only the whole-matrix stack's
    # (a matrix whole on each shard, as under DDP, always splits its NS over the replicas)
    assert r["split"]["split"]["bytes"][0] > r["split"]["repeat"]["bytes"][0], r["split"]
    for i, (a, b) in enumerate(zip(r["split"]["repeat"]["weights"], r["split"]["split"]["weights"])):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (i, (a - b).abs().max())
    assert 0 < r["comp_bytes"][-1] <= 0.3 * r["fsdp_bytes"], (r["comp_bytes"], r["fsdp_bytes"])
    assert all(r["later"][4]["identical"]), r["later"][4]["identical"]
    assert r["norms"] == pytest.approx({2.0: (29.0) ** 0.5, 1.0: 5.0, float("inf"): 7.0}), r["norms"]
    for i, (a, b) in enumerate(zip(r["later"][None]["weights"], r["later"][4]["weights"])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (i, (a - b).abs().max())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(32, 96, bias=False)
        self.down = nn.Linear(96, 32, bias=False)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _fsdp_worker(rank, world, divide, out):
    from torch.distributed.fsdp import fully_shard

    from dion3_titan.dist.fsdp import reduce_within_replicas
    from dion3_titan.optim.routing import build_param_groups
    from dion3_titan.titan02.cpu_shims import shared

    shared.fsdp_sum_reductions()  # gloo has no AVG / PREMUL_SUM
    mesh = _mesh()
    results = {}
    for sync in ("gradients", "compressed"):
        model = Block()
        fully_shard(model, mesh=mesh)
        if divide is not None:  # torchtitan sums (and scales the loss itself)
            model.set_gradient_divide_factor(divide)
        if sync == "compressed":
            assert reduce_within_replicas(model) == 1
        groups = build_param_groups(model.named_parameters(), adamw_lr=0.01)
        from dion3_titan import Dion3

        opt = Dion3(
            groups,
            lr=0.05,
            fraction=0.25,
            flavor="normuon",
            selection="random",
            ns_dtype="float32",
            backend="torch",
            replicate_sync=sync,
        )
        identical = []
        for step in range(6):
            g = torch.Generator().manual_seed(100 * step + rank)  # every DP rank its own batch
            loss = model(torch.randn(16, 32, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            identical.append(_replicas_identical(mesh, list(model.parameters())))
        results[sync] = {"weights": [p.full_tensor() for p in model.parameters()], "identical": identical}
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("divide", [None, 1.0], ids=["fsdp_mean", "titan_sum"])
def test_fsdp_within_replicas_equals_native_hsdp(tmp_path, divide):
    out = tmp_path / "r.pt"
    spawn(R * S, _fsdp_worker, divide, str(out))
    r = torch.load(out)
    assert all(r["compressed"]["identical"]), r["compressed"]["identical"]
    for i, (a, b) in enumerate(zip(r["gradients"]["weights"], r["compressed"]["weights"])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (i, (a - b).abs().max())


def test_compressed_needs_replicas():
    from dion3_titan import Dion3

    p = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="replicate_sync='compressed' needs matrices replicated"):
        Dion3([p], replicate_sync="compressed")
    with pytest.raises(ValueError, match=r"replicate_sync='nope': allowed values are \('gradients', 'compressed'\)"):
        Dion3([p], replicate_sync="nope")
    with pytest.raises(ValueError, match=r"replicate_ns='twice': allowed values are \('repeat', 'split'\)"):
        Dion3([p], replicate_ns="twice")
    from dion3_titan.optim.prmuon import PeriodicRowwiseMuon

    with pytest.raises(ValueError, match="replicate_sync='compressed': PeriodicRowwiseMuon allows only"):
        PeriodicRowwiseMuon([p], replicate_sync="compressed")
