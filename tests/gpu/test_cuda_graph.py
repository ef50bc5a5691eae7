"""A captured optimizer step gives bit-identical parameters to eager steps (1 GPU, and 2 GPUs
with FSDP2 over NCCL), with a live learning-rate schedule and live weight-decay changes."""

import copy

import pytest
import torch
import torch.nn as nn

from tests.spawn import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SHAPES = [(64, 256), (64, 256), (256, 64), (128, 128), (4, 32, 96), (256,)]


def _model(device):
    g = torch.Generator().manual_seed(0)
    m = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])
    return m.to(device)


def _grads(step, device):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def _train(model, graphed: bool, fraction: float, flavor: str, steps: int, device, wd_changes=None):
    """Final parameters and the number of graph captures. ``wd_changes``: {step: (matrix
    weight decay, AdamW weight decay)}, set before that step."""
    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    mats = [p for p in model if p.ndim >= 2]
    vecs = [p for p in model if p.ndim < 2]
    opt = Dion3([{"params": mats}, {"params": vecs, "algorithm": "adamw"}], lr=0.02,
                fraction=fraction, flavor=flavor, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    runner = GraphedOptimizer(opt, warmup_steps=3) if graphed else opt
    captures, graph = 0, None
    for step in range(steps):
        if step in (wd_changes or {}):
            for group, wd in zip(opt.param_groups, wd_changes[step]):
                group["weight_decay"] = wd
        for p, g in zip(model, _grads(step, device)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g)
        runner.step()
        sched.step()
        if graphed and runner._graph is not graph:  # this step captured a graph
            captures, graph = captures + 1, runner._graph
    torch.cuda.synchronize()
    if graphed:
        runner.release()
    return [p.detach().clone() for p in model], captures


@pytest.mark.parametrize("fraction,flavor", [(1.0, "muon"), (0.25, "normuon")])
def test_graph_equals_eager_one_gpu(fraction, flavor):
    base = _model("cuda")
    eager, _ = _train(copy.deepcopy(base), False, fraction, flavor, 20, "cuda")
    graphed, _ = _train(copy.deepcopy(base), True, fraction, flavor, 20, "cuda")
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


def test_live_weight_decay_change_under_graph():
    """Weight decay changed after capture: the matrices' value is read live (no re-capture),
    the AdamW group's is baked into the graph (torch's AdamW takes it as a float), so changing
    it re-captures. Both give the eager run's bits."""
    changes = {6: (0.3, 0.1), 9: (0.3, 0.05), 12: (0.0, 0.05), 15: (0.0, 0.0)}
    base = _model("cuda")
    eager, _ = _train(copy.deepcopy(base), False, 0.25, "normuon", 18, "cuda", changes)
    graphed, captures = _train(copy.deepcopy(base), True, 0.25, "normuon", 18, "cuda", changes)
    assert captures == 3  # the first capture, then the AdamW changes at steps 9 and 15
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    unchanged, _ = _train(copy.deepcopy(base), False, 0.25, "normuon", 18, "cuda")
    assert all(not torch.equal(a, b) for a, b in zip(eager, unchanged))  # the changes took effect


def _fsdp_worker(rank, world, out_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    results = []
    for graphed in (False, True):
        model = _model(f"cuda:{rank}")
        fully_shard(model)
        params = list(model)
        opt = Dion3([{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}],
                    lr=0.02, fraction=0.25, flavor="normuon", weight_decay=0.1)
        runner = GraphedOptimizer(opt, warmup_steps=3) if graphed else opt
        for step in range(20):
            for p, g in zip(params, _grads(step, f"cuda:{rank}")):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements)  # new tensors each step
            runner.step()
        torch.cuda.synchronize()
        results.append([p.full_tensor().cpu() for p in params])
        if graphed:
            runner.release()
    if rank == 0:
        torch.save(results, out_path)


@pytest.mark.multigpu
def test_graph_equals_eager_fsdp_two_gpus(tmp_path):
    out = tmp_path / "g.pt"
    spawn(2, _fsdp_worker, str(out), backend="nccl")
    eager, graphed = torch.load(out)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
