"""A NaN in one gradient on one rank of a 2-rank FSDP run: "raise" fails on every rank with the
parameter's name (no hang); "skip" leaves every parameter and every optimizer state tensor
(matrices and AdamW) bit-identical and the next step trains normally. Eager steps, and the
step body a CUDA graph captures (its flag read at the next step)."""

import pytest
import torch

from tests.spawn import spawn
from tests.test_dist_fsdp import SHAPES, Bag, grads_for

pytestmark = pytest.mark.timeout(300)

WITH_VECTOR = {**SHAPES, "v": (40,)}  # "v0" goes to the AdamW group


def _bits(t):
    return t.to_local().detach().reshape(-1).clone().view(torch.uint8)


def _worker(rank, world, mode, path, out_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from dion3_titan import Dion3

    model = Bag(1, WITH_VECTOR)
    fully_shard(model)
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.ndim >= 2]
    vecs = [(n, p) for n, p in named if p.ndim < 2]
    params = [p for _, p in mats + vecs]
    opt = Dion3([{"params": [p for _, p in mats], "names": [n for n, _ in mats]},
                 {"params": [p for _, p in vecs], "names": [n for n, _ in vecs], "algorithm": "adamw"}],
                lr=0.05, fraction=0.25, flavor="normuon", weight_decay=0.1, ns_dtype="float32",
                nonfinite=mode, backend="torch")
    shapes = [tuple(p.shape) for p in params]

    def step():
        if path == "eager":
            opt.step()
        else:  # what GraphedOptimizer does around a replay
            opt.nonfinite.resolve()
            opt.load_hyperparameters()
            opt.step_body(sync_check=False)
            opt.nonfinite.issued()

    def set_grads(step, poison=False):
        for i, (p, g) in enumerate(zip(params, grads_for(step, shapes))):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            if poison and i == 0 and rank == 1:
                p.grad.to_local().view(-1)[0] = float("nan")

    def snapshot():
        return [_bits(p) for p in params] + [_bits(v) if hasattr(v, "to_local") else v.clone()
                                             for p in params for v in opt.state[p].values()]

    for s in range(2):
        set_grads(s)
        step()
    before = snapshot()
    assert len(before) == len(params) + 2 * len(mats) + 3 * len(vecs)  # momentum, variance; AdamW's three
    set_grads(2, poison=True)
    messages, same = [], None
    for s in (2, 3):  # the bad step, then a good one (where a deferred flag is read)
        try:
            step()
        except FloatingPointError as exc:
            messages.append((s, str(exc)))
            break
        if s == 2:
            same = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
        set_grads(3)
    same_after = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    torch.save({"messages": messages, "same": same, "same_after": same_after, "skipped": opt.skipped_steps},
               f"{out_path}.{rank}")


@pytest.mark.parametrize("path", ["eager", "deferred"])
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_nan_gradient_on_one_rank(tmp_path, mode, path):
    out = str(tmp_path / "r")
    spawn(2, _worker, mode, path, out)
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        if mode == "raise":
            # eager: raised by the bad step itself; deferred: by the next step, before its body
            assert [s for s, _ in r["messages"]] == [2 if path == "eager" else 3], r["messages"]
            message = r["messages"][0][1]
            assert "a0" in message and "rank 1" in message, message
            assert r["same_after"], "parameters or state changed by a non-finite step"
        else:
            assert r["messages"] == [] and r["skipped"] == 1
            assert r["same"], "parameters or state changed on a non-finite step"
            assert not r["same_after"], "the next finite step did not train"
