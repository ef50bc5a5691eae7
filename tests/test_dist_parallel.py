"""Dion3 under HSDP (2 x 2), FSDP x TP (2 x 2, colwise and rowwise linears), EP = 2 with
expert weights, and EP = 2 under FSDP2 as torchtitan applies it (the experts _StridedShard on
their expert dim, or FSDP on their rows), on 4 gloo ranks, equals the single-process textbook
update fed the same gradients (global scope; f = 1 is scope-free)."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.dist_reference import TextbookDion3, dion3_like_textbook
from tests.spawn import spawn_each

pytestmark = pytest.mark.timeout(900)

CONFIGS = [(1.0, "muon", "local"), (0.25, "normuon", "global")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(32, 96, bias=False)  # tall
        self.gate = nn.Linear(32, 96, bias=False)
        self.down = nn.Linear(96, 32, bias=False)  # wide
        self.sq = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return self.sq(self.down(torch.relu(self.up(x)) * self.gate(x)))


def _train(model, opt, steps, rank):
    """Real forward/backward; returns the full gradients each step for the reference."""
    grads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(128, 32, generator=g)  # full-rank gradients: NS amplifies rounding in null directions
        loss = model(x).square().mean()
        loss.backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


def _check(rank, world, model, init, grads, cfg, out):
    fraction, flavor, scope = cfg
    final = [p.full_tensor() for p in model.parameters()]
    ref = TextbookDion3(
        [w.shape for w in init],
        lr=0.05,
        fraction=fraction,
        flavor=flavor,
        wd=0.1,
        chunks=None if scope == "global" else 2,
    )
    weights = [w.clone() for w in init]
    for g in grads:
        ref.step(weights, g)
    if rank == 0:
        torch.save({"got": final, "want": weights}, out)


def _dion3(params, cfg):
    fraction, flavor, scope = cfg
    return dion3_like_textbook(params, fraction, flavor, scope, selection_dim="rows")


def _hsdp_worker(rank, world, cfg, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Block()
    init = [p.detach().clone() for p in model.parameters()]
    fully_shard(model, mesh=mesh)
    opt = _dion3(model.parameters(), cfg)
    grads = _train(model, opt, 4, rank)
    _check(rank, world, model, init, grads, cfg, out)


def _tp_worker(rank, world, cfg, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Block()
    init = [p.detach().clone() for p in model.parameters()]
    parallelize_module(
        model,
        mesh["tp"],
        {
            "up": ColwiseParallel(),
            "gate": ColwiseParallel(),
            "down": RowwiseParallel(),
            "sq": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    fully_shard(model, mesh=mesh["dp"])
    opt = _dion3(model.parameters(), cfg)
    grads = _train(model, opt, 4, rank // 2)  # the same batch on both TP ranks
    _check(rank, world, model, init, grads, cfg, out)


def _ep_worker(rank, world, cfg, out):
    """Experts sharded over an EP mesh dim (whole experts) and their rows over an FSDP dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "fsdp"))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(4, 24, 40, generator=gen), torch.randn(4, 40, 24, generator=gen)]
    params = [nn.Parameter(distribute_tensor(w, mesh, [Shard(0), Shard(1)])) for w in full]
    opt = _dion3(params, cfg)
    grads = []
    for step in range(4):
        g = torch.Generator().manual_seed(500 + step)
        gs = [torch.randn(w.shape, generator=g) for w in full]
        for p, gg in zip(params, gs):
            p.grad = distribute_tensor(gg, mesh, p.placements)
        grads.append(gs)
        opt.step()
    model = nn.ParameterList(params)
    _check(rank, world, model, full, grads, (cfg[0], cfg[1], "global" if cfg[0] < 1 else cfg[2]), out)


class Experts(nn.Module):
    def __init__(self, full: list[torch.Tensor]) -> None:
        super().__init__()
        self.w1, self.w2 = (nn.Parameter(w.clone()) for w in full)


def _ep_fsdp(rank, world, cfg, out, fsdp_dim):
    """torchtitan's EP x FSDP: EP shards the experts (Shard(0) on the ep mesh dim), then
    fully_shard on the efsdp dim shards them again, on the expert dim (FSDP's default: the
    placement becomes _StridedShard) or on the rows (its Shard(1) placement function)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(4, 24, 40, generator=gen), torch.randn(4, 40, 24, generator=gen)]
    experts = Experts(full)
    for name, p in list(experts.named_parameters()):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh["ep"], [Shard(0)])))
    fully_shard(experts, mesh=mesh["efsdp"], shard_placement_fn=lambda p: Shard(fsdp_dim))
    params = list(experts.parameters())
    strided = [type(p.placements[0]).__name__ == "_StridedShard" for p in params]
    assert strided == [fsdp_dim == 0] * 2, [p.placements for p in params]
    opt = _dion3(params, cfg)
    grads = []
    for step in range(4):
        g = torch.Generator().manual_seed(500 + step)
        gs = [torch.randn(w.shape, generator=g) for w in full]
        for p, gg in zip(params, gs):
            p.grad = distribute_tensor(gg, p.device_mesh, p.placements, src_data_rank=None)
        grads.append(gs)
        opt.step()
    _check(rank, world, experts, full, grads, (cfg[0], cfg[1], "global" if cfg[0] < 1 else cfg[2]), out)


def _ep_fsdp_experts_worker(rank, world, cfg, out):
    _ep_fsdp(rank, world, cfg, out, fsdp_dim=0)


def _ep_fsdp_rows_worker(rank, world, cfg, out):
    _ep_fsdp(rank, world, cfg, out, fsdp_dim=1)


WORKERS = {
    "hsdp": _hsdp_worker,
    "fsdp_tp": _tp_worker,
    "ep": _ep_worker,
    "ep_fsdp_strided": _ep_fsdp_experts_worker,
    "ep_fsdp_rows": _ep_fsdp_rows_worker,
}
CFG_IDS = ["f1-muon", "f0.25-normuon-global"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str | None]]:
    """Every layout x config in turn on one set of 4 ranks (their start-up is most of the cost)."""
    folder = tmp_path_factory.mktemp("parallel")
    jobs = {
        f"{cfg_id}-{layout}": (worker, (cfg, str(folder / f"{cfg_id}-{layout}.pt")))
        for layout, worker in WORKERS.items()
        for cfg, cfg_id in zip(CONFIGS, CFG_IDS)
    }
    return folder, spawn_each(4, jobs, folder)


@pytest.mark.parametrize("layout", list(WORKERS))
@pytest.mark.parametrize("cfg_id", CFG_IDS)
def test_parallel_layouts_match_single_process(runs, layout, cfg_id):
    folder, status = runs
    name = f"{cfg_id}-{layout}"
    assert status[name] is None, status[name]
    r = torch.load(folder / f"{name}.pt")
    for i, (a, b) in enumerate(zip(r["got"], r["want"])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (i, (a - b).abs().max())
