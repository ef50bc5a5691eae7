"""A split parameter's NorMuon state reshards: FSDP cuts fused QKV, gate/up and interleaved
pieces unevenly (Q on the first ranks only, odd row offsets), yet the state saved with DCP at
world size 2 loads at 1, 2 and 4, and the next step equals the 2-rank run's."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.spawn import spawn
from tests.test_split import SPLIT, Holder, fused_tensors, separate_tensors

pytestmark = pytest.mark.timeout(600)

SAVE_AT = 3  # steps before the checkpoint; one more step after it is compared


def _build():
    from torch.distributed.fsdp import fully_shard

    from dion3_titan import Dion3

    model = Holder(fused_tensors(separate_tensors(0, 1), 1))
    fully_shard(model)
    params = list(model.parameters())
    opt = Dion3(
        [{"params": params, "names": model.names}],
        lr=0.05,
        weight_decay=0.1,
        fraction=0.5,
        flavor="normuon",
        selection_scope="global",
        ns_dtype="float32",
        backend="torch",
        selection_dim="rows",
        **SPLIT,
    )
    return model, params, opt


def _step(model, params, opt, step):
    from torch.distributed.tensor import distribute_tensor

    grads = fused_tensors(separate_tensors(1000 + step, 1, scale_rows=True), 1)
    for p, g in zip(params, grads.values()):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
    opt.step()


def _finish(model, params, opt, rank, out):
    _step(model, params, opt, SAVE_AT)
    final = {n: p.full_tensor() for n, p in zip(model.names, params)}
    variance = {n: opt.state[p]["variance"].full_tensor() for n, p in zip(model.names, params)}
    if rank == 0:
        torch.save({"final": final, "variance": variance}, out)


def _save_worker(rank, world, ckpt, out):
    model, params, opt = _build()
    for step in range(SAVE_AT):
        _step(model, params, opt, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    _finish(model, params, opt, rank, out)


def _load_worker(rank, world, ckpt, out):
    model, params, opt = _build()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _finish(model, params, opt, rank, out)


def test_uneven_split_pieces_state_reshards(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    spawn(2, _save_worker, ckpt, str(tmp_path / "want.pt"))
    want = torch.load(tmp_path / "want.pt")
    assert all(v.abs().sum() > 0 for v in want["variance"].values())  # the state is not trivially zero
    for world in (1, 2, 4):
        out = tmp_path / f"got{world}.pt"
        spawn(world, _load_worker, ckpt, str(out))
        got = torch.load(out)
        for kind in ("final", "variance"):
            for name, a in got[kind].items():
                b = want[kind][name]
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (world, kind, name, (a - b).abs().max())
