"""Newton-Schulz on its own stream beside the memory-bound stages (optim/overlap.py) gives the
bits of the one-stream order, eagerly and in a captured step; persistent kernels that leave
SMs free (kernels/tma.py ``leave_sms``) compute every tile as before."""

import copy

import pytest
import torch
import torch.nn as nn

from dion3_titan.optim import overlap
from tests.inputs import random_grads

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# the square 2048 batch is the costliest group (persistent kernels, CuteDSL on Hopper); the
# others have Gram sides 512 and 128
SHAPES = [(2048, 2048)] * 6 + [(512, 2048)] * 4 + [(2048, 512)] * 3 + [(128, 640)] * 2 + [(2048,)]


def _model():
    g = torch.Generator().manual_seed(0)
    return nn.ParameterList([nn.Parameter(0.02 * torch.randn(s, generator=g)) for s in SHAPES]).to("cuda")


def _train(model, ns_overlap: bool, graphed: bool, fraction: float, flavor: str, weight_decay: float, steps: int):
    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    mats = [p for p in model if p.ndim >= 2]
    vecs = [p for p in model if p.ndim < 2]
    opt = Dion3(
        [{"params": mats}, {"params": vecs, "algorithm": "adamw"}],
        lr=0.02,
        fraction=fraction,
        flavor=flavor,
        weight_decay=weight_decay,
        ns_overlap=ns_overlap,
    )
    runner = GraphedOptimizer(opt, warmup_steps=2) if graphed else opt
    for step in range(steps):
        for p, g in zip(model, random_grads(300 + step, SHAPES, row_scale=True)):
            p.grad = g.to("cuda")
        runner.step()
    torch.cuda.synchronize()
    if graphed:
        runner.release()
    momenta = [opt.state[p]["momentum"].clone() for p in mats]
    return [p.detach().clone() for p in model], momenta


@pytest.mark.parametrize(
    "fraction,flavor,weight_decay,graphed",
    [
        (0.25, "normuon", 0.0, True),
        (0.25, "normuon", 0.01, False),
        (0.25, "normuon", 0.01, True),
        (1.0, "muon", 0.01, True),
    ],
)
def test_overlapped_step_gives_the_sequential_bits(monkeypatch, fraction, flavor, weight_decay, graphed):
    """With weight decay at f < 1 the last group's rows that are not selected decay on the
    step stream (``decay_unselected``) while its update visits the selected rows alone."""
    from dion3_titan.optim.stages_engine import RowEngineStages

    runs, split = [], []
    real_run, real_decay = overlap.Overlap.run, RowEngineStages.decay_unselected

    def counted(self, *args, **kwargs):
        runs.append(1)
        return real_run(self, *args, **kwargs)

    def decay_counted(self, *args, **kwargs):
        split.append(1)
        return real_decay(self, *args, **kwargs)

    monkeypatch.setattr(overlap.Overlap, "run", counted)
    monkeypatch.setattr(RowEngineStages, "decay_unselected", decay_counted)
    base = _model()
    steps = 6 if graphed else 3
    seq = _train(copy.deepcopy(base), False, graphed, fraction, flavor, weight_decay, steps)
    assert not runs
    over = _train(copy.deepcopy(base), True, graphed, fraction, flavor, weight_decay, steps)
    assert runs, "the overlapped schedule did not run"
    assert bool(split) == (weight_decay > 0 and fraction < 1), f"decay split off {len(split)} times"
    for kind, a_list, b_list in (("parameter", seq[0], over[0]), ("momentum", seq[1], over[1])):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert torch.equal(a, b), f"{kind} {i} {tuple(a.shape)}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_leave_sms_keeps_every_tile(backend):
    """A symmetric product and X <- aX + BX on fewer programs than SMs: the same bits."""
    from dion3_titan.kernels import dispatch
    from dion3_titan.kernels.tma import leave_sms

    if backend == "cute":
        from dion3_titan.kernels import cute_symm

        if not cute_symm.is_available():
            pytest.skip("CuteDSL on Hopper needed")
    ops = dispatch.get_backend(backend)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(16, 1024, 4096, device="cuda", generator=g).half() / 64
    c = torch.randn(16, 1024, 1024, device="cuda", generator=g).half()
    c = (c + c.mT) / 2
    full = (ops.sym_mm(x, x.mT), ops.sym_addmm(x, x.mT, c, 0.5, 2.0), ops.mm_add(c, x, x, 1.5, 1.0))
    with leave_sms(40):
        fewer = (ops.sym_mm(x, x.mT), ops.sym_addmm(x, x.mT, c, 0.5, 2.0), ops.mm_add(c, x, x, 1.5, 1.0))
    for name, a, b in zip(("sym_mm", "sym_addmm", "mm_add"), full, fewer):
        assert torch.equal(a, b), f"{backend} {name}: max diff {(a.float() - b.float()).abs().max().item():.3e}"
