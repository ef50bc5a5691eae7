"""A NaN in one gradient on one rank of a 2-rank FSDP run: "raise" fails on every rank with the
parameter's name (no hang); "skip" leaves parameters and optimizer state bit-identical and the
next step trains normally."""

import pytest
import torch

from tests.spawn import spawn
from tests.test_dist_fsdp import Bag, grads_for

pytestmark = pytest.mark.timeout(300)


def _worker(rank, world, mode, out_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from dion3_titan import Dion3

    model = Bag(1)
    fully_shard(model)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = Dion3([{"params": params, "names": names}], lr=0.05, fraction=0.25, flavor="normuon",
                ns_dtype="float32", nonfinite=mode, backend="torch")
    shapes = [tuple(p.shape) for p in params]

    def set_grads(step, poison=False):
        for i, (p, g) in enumerate(zip(params, grads_for(step, shapes))):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            if poison and i == 0 and rank == 1:
                p.grad.to_local().view(-1)[0] = float("nan")

    set_grads(0)
    opt.step()
    before = [p.detach().to_local().clone() for p in params]
    state_before = {k: v.to_local().clone() for k, v in opt.state[params[0]].items()}
    set_grads(1, poison=True)
    message = ""
    try:
        opt.step()
    except FloatingPointError as exc:
        message = str(exc)
    after = [p.detach().to_local() for p in params]
    same = all(torch.equal(a, b) for a, b in zip(before, after)) and all(
        torch.equal(state_before[k], v.to_local()) for k, v in opt.state[params[0]].items()
    )
    set_grads(2)
    opt.step()  # training continues
    moved = not all(torch.equal(a, b.detach().to_local()) for a, b in zip(before, params))
    torch.save({"message": message, "same": same, "moved": moved, "skipped": opt.skipped_steps}, f"{out_path}.{rank}")


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_nan_gradient_on_one_rank(tmp_path, mode):
    out = str(tmp_path / "r")
    spawn(2, _worker, mode, out)
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        assert r["same"], "parameters or state changed on a non-finite step"
        assert r["moved"]
        if mode == "raise":
            assert "a0" in r["message"] and "rank 1" in r["message"], r["message"]
        else:
            assert r["message"] == "" and r["skipped"] == 1
