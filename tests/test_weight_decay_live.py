"""Weight decay changed between steps takes effect on the next step, in both groups, and the
host-side rules of a captured step (optim/cuda_graph.py) handle it: the matrices' weight decay
is a device value refreshed before each replay, the AdamW group's is baked into the graph and
changing it re-captures (as does changing the matrices' momentum). (The replay itself:
tests/gpu/test_cuda_graph.py.)"""

import copy
import math

import torch

from dion3_titan import Dion3
from dion3_titan.optim.cuda_graph import GraphedOptimizer
from tests.inputs import random_grads

SEED = 0
SHAPES = [(16, 48), (48, 16), (2, 16, 24), (48,)]


def _params():
    g = torch.Generator().manual_seed(SEED)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _optimizer(params, wd=0.1):
    return Dion3(
        [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}],
        lr=0.05,
        fraction=0.5,
        flavor="normuon",
        weight_decay=wd,
        ns_dtype="float32",
        backend="torch",
    )


def _step(params, opt, step):
    for p, g in zip(params, random_grads(100 + step, [p.shape for p in params])):
        p.grad = g.to(p.dtype)
    opt.step()


def test_changed_weight_decay_applies_to_the_next_step():
    """Two runs from the same state and gradients, one with each group's weight decay raised
    before the last step: they differ by exactly the extra decay lr * dwd * W (the update is
    the same), for the matrices (with their transferred lr, lr / sqrt(f)) and the AdamW group."""
    a = _params()
    opt_a = _optimizer(a)
    for step in range(3):
        _step(a, opt_a, step)
    b = copy.deepcopy(a)
    opt_b = _optimizer(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    before = [p.detach().clone() for p in a]
    for group, wd in zip(opt_a.param_groups, (0.4, 0.3)):
        group["weight_decay"] = wd
    _step(a, opt_a, 3)
    _step(b, opt_b, 3)
    for i, (pa, pb, w) in enumerate(zip(a, b, before)):
        matrix = i < len(a) - 1
        dwd, lr = (0.3, 0.05 / math.sqrt(0.5)) if matrix else (0.2, 0.05)
        expected = -lr * dwd * w
        assert (pa - pb).abs().max() > 1e-4  # the change did something
        # equal up to the rounding of the float32 weights (the update is the same bits)
        assert torch.allclose(pa - pb, expected, rtol=1e-4, atol=2e-6), (SEED, i, (pa - pb - expected).abs().max())


def test_graph_signature_and_live_values():
    params = _params()
    opt = _optimizer(params)
    graphed = GraphedOptimizer(opt, warmup_steps=1)  # host logic only: nothing is captured on CPU
    signature = graphed.signature()
    opt.load_hyperparameters()
    assert torch.allclose(opt._hyper_all, torch.tensor([[0.05, 0.1], [0.05, 0.1]]))

    opt.param_groups[0]["weight_decay"] = 0.25  # matrices: read live, no re-capture
    assert graphed.signature() == signature
    opt.load_hyperparameters()  # what every replay runs first
    assert torch.allclose(opt._hyper_all[0], torch.tensor([0.05, 0.25]))

    opt.param_groups[1]["weight_decay"] = 0.0  # AdamW: a float in the graph, re-capture
    assert graphed.signature() != signature
    opt.load_hyperparameters()
    assert torch.allclose(opt._hyper_all[1], torch.tensor([0.05, 0.0]))

    # matrices without weight decay: the update leaves unselected rows unread, so turning it
    # on or off re-captures (its size stays live)
    signature = graphed.signature()
    opt.param_groups[0]["weight_decay"] = 0.0
    off = graphed.signature()
    assert off != signature
    opt.param_groups[0]["weight_decay"] = 0.5
    assert graphed.signature() == signature

    # the matrices' momentum is a constant of the kernels that decay it: changing it (a
    # momentum schedule) re-captures, so the next step uses the new value
    opt.param_groups[0]["momentum"] = 0.85
    assert graphed.signature() != signature
    opt.param_groups[0]["momentum"] = 0.95
    assert graphed.signature() == signature
