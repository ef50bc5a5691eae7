"""``megabatch = false`` (batches of as many matrices as shards, one pair of collectives each)
gives the same update as the megabatched plan (one batch and one pair per shape group), under
FSDP2 on 2 gloo ranks, up to float32 rounding of the differently packed batches."""

import pytest
import torch

from tests.dist_reference import dion3_like_textbook
from tests.spawn import spawn
from tests.test_dist_fsdp import SHAPES, Bag, grads_for

pytestmark = pytest.mark.timeout(600)

CONFIGS = [(1.0, "muon", "local"), (0.25, "normuon", "global")]
STEPS = 4


def _run(megabatch, fraction, flavor, scope):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = Bag(3)  # three matrices of each shape: a shape group has several members
    shapes = [tuple(p.shape) for p in model.parameters()]
    fully_shard(model)
    params = list(model.parameters())
    opt = dion3_like_textbook(params, fraction, flavor, scope, megabatch=megabatch)
    for step in range(STEPS):
        for p, g in zip(params, grads_for(step, shapes)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.comm_stats.reset()
        opt.step()
    return {"final": [p.full_tensor() for p in params], "groups": len(opt._groups), "calls": opt.comm_stats.calls}


def _worker(rank, world, out_path):
    results = [{mb: _run(mb, *cfg) for mb in (True, False)} for cfg in CONFIGS]
    if rank == 0:
        torch.save(results, out_path)


def test_megabatch_off_gives_the_same_update(tmp_path):
    out = tmp_path / "r.pt"
    spawn(2, _worker, str(out))
    for cfg, r in zip(CONFIGS, torch.load(out)):
        on, off = r[True], r[False]
        # the plans differ (so the comparison means something): more batches, more collectives
        assert off["groups"] > on["groups"] and off["calls"] > on["calls"], (cfg, on["groups"], off["groups"])
        bitwise = all(torch.equal(a, b) for a, b in zip(on["final"], off["final"]))
        for name, a, b in zip([f"{n}{i}" for i in range(3) for n in SHAPES], on["final"], off["final"]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (cfg, name, (a - b).abs().max())
        print(
            cfg,
            "bitwise equal" if bitwise else "equal to rounding",
            f"groups {on['groups']} -> {off['groups']}, collectives {on['calls']} -> {off['calls']}",
        )
