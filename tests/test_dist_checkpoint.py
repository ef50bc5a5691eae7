"""Optimizer state saved with torch.distributed.checkpoint at world size 2 loads at world
sizes 1 and 4 (resharded) and the next step equals the 2-rank run's."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.spawn import spawn
from tests.test_dist_fsdp import SHAPES, Bag, grads_for

pytestmark = pytest.mark.timeout(600)


def _build():
    from torch.distributed.fsdp import fully_shard

    from dion3_titan import Dion3

    model = Bag(1)
    model.register_parameter("bias0", torch.nn.Parameter(torch.randn(7)))
    fully_shard(model)
    params = list(model.parameters())
    opt = Dion3(
        [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}],
        lr=0.05,
        fraction=0.25,
        flavor="normuon",
        selection_scope="global",
        ns_dtype="float32",
        weight_decay=0.1,
        backend="torch",
    )
    return model, params, opt


def _step(params, opt, step):
    from torch.distributed.tensor import distribute_tensor

    shapes = [tuple(p.shape) for p in params]
    for p, g in zip(params, grads_for(step, shapes)):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
    opt.step()


def _save_worker(rank, world, ckpt, out):
    model, params, opt = _build()
    for step in range(3):
        _step(params, opt, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    _step(params, opt, 3)
    final = [p.full_tensor() for p in params]
    if rank == 0:
        torch.save(final, out)


def _load_worker(rank, world, ckpt, out):
    model, params, opt = _build()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(params, opt, 3)
    final = [p.full_tensor() for p in params]
    if rank == 0:
        torch.save(final, out)


def test_dcp_reshards_optimizer_state(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    spawn(2, _save_worker, ckpt, str(tmp_path / "want.pt"))
    want = torch.load(tmp_path / "want.pt")
    for world in (1, 4):
        out = tmp_path / f"got{world}.pt"
        spawn(world, _load_worker, ckpt, str(out))
        got = torch.load(out)
        for name, a, b in zip([*SHAPES, "bias"], got, want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (world, name, (a - b).abs().max())
