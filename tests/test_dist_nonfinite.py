"""A NaN in one gradient on one rank of a 2-rank FSDP run: "raise" fails on every rank with the
parameter's name (no hang); "skip" leaves every parameter and every optimizer state tensor
(matrices and AdamW) bit-identical and the next step trains normally. Eager steps, the step
body a CUDA graph captures (its flag read at the next step), and eager steps given the global
gradient norm as torchtitan's clipping computes it (the flag from the norm: no pass, no
all-reduce of the flag; "raise" says the norm was not finite)."""

from pathlib import Path

import pytest
import torch

from tests.spawn import spawn_each
from tests.test_dist_fsdp import SHAPES, Bag, grads_for

pytestmark = pytest.mark.timeout(300)

WITH_VECTOR = {**SHAPES, "v": (40,)}  # "v0" goes to the AdamW group


def _bits(t):
    return t.to_local().detach().reshape(-1).clone().view(torch.uint8)


def _build(mode):
    from torch.distributed.fsdp import fully_shard

    from dion3_titan import Dion3

    model = Bag(1, WITH_VECTOR)
    fully_shard(model)
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.ndim >= 2]
    vecs = [(n, p) for n, p in named if p.ndim < 2]
    params = [p for _, p in mats + vecs]
    opt = Dion3(
        [
            {"params": [p for _, p in mats], "names": [n for n, _ in mats]},
            {"params": [p for _, p in vecs], "names": [n for n, _ in vecs], "algorithm": "adamw"},
        ],
        lr=0.05,
        fraction=0.25,
        flavor="normuon",
        weight_decay=0.1,
        ns_dtype="float32",
        nonfinite=mode,
        backend="torch",
    )
    return params, opt, len(mats), len(vecs)


def _worker(rank, world, mode, path, out_path):
    from torch.distributed.tensor import distribute_tensor

    params, opt, n_mats, n_vecs = _build(mode)
    shapes = [tuple(p.shape) for p in params]

    def step(opt):
        if path == "norm":  # torchtitan's clipping: the norm of the DTensor gradients, reduced
            grads = [p.grad for g in opt.param_groups for p in g["params"]]
            opt.use_gradient_norm(torch.nn.utils.get_total_norm(grads).full_tensor())
        if path in ("eager", "norm"):
            opt.step()
        else:  # what GraphedOptimizer does around a replay
            opt.nonfinite.resolve()
            opt.load_hyperparameters()
            opt.step_body()
            opt.nonfinite.issued()

    def set_grads(params, step, poison=False):
        for i, (p, g) in enumerate(zip(params, grads_for(step, shapes))):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            if poison and i == 0 and rank == 1:
                p.grad.to_local().view(-1)[0] = float("nan")

    def snapshot(params, opt):
        """Every parameter, then every state tensor of every parameter (local shards, bits)."""
        return [_bits(p) for p in params] + [
            _bits(v) if hasattr(v, "to_local") else v.clone() for p in params for v in opt.state[p].values()
        ]

    for s in range(2):
        set_grads(params, s)
        step(opt)
    before = snapshot(params, opt)
    assert len(before) == len(params) + 2 * n_mats + 3 * n_vecs  # momentum, variance; AdamW's three
    set_grads(params, 2, poison=True)
    messages, same = [], None
    for s in (2, 3):  # the bad step, then a good one (where a deferred flag is read)
        try:
            step(opt)
        except FloatingPointError as exc:
            messages.append((s, str(exc)))
            break
        if s == 2:
            same = [torch.equal(a, b) for a, b in zip(before, snapshot(params, opt))]
        set_grads(params, 3)
    after = snapshot(params, opt)
    same_after = [torch.equal(a, b) for a, b in zip(before, after)]
    as_if_never = None
    if mode == "skip":  # a run that never took the bad step: steps 0, 1, 3
        ref_params, ref_opt, _, _ = _build(mode)
        for s in (0, 1, 3):
            set_grads(ref_params, s)
            step(ref_opt)
        if path == "deferred":
            ref_opt.nonfinite.resolve()
        as_if_never = [torch.equal(a, b) for a, b in zip(after, snapshot(ref_params, ref_opt))]
    torch.save(
        {
            "messages": messages,
            "same": same,
            "same_after": same_after,
            "skipped": opt.skipped_steps,
            "as_if_never": as_if_never,
            "sources": opt.nonfinite.flag_sources,
        },
        f"{out_path}.{rank}",
    )


MODES, PATHS = ["raise", "skip"], ["eager", "deferred", "norm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str | None]]:
    """Every mode x path in turn on one pair of ranks (their start-up is most of the cost)."""
    folder = tmp_path_factory.mktemp("nonfinite")
    jobs = {f"{m}-{p}": (_worker, (m, p, str(folder / f"{m}-{p}"))) for m in MODES for p in PATHS}
    return folder, spawn_each(2, jobs, folder)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_nan_gradient_on_one_rank(runs, mode, path):
    folder, status = runs
    assert status[f"{mode}-{path}"] is None, status[f"{mode}-{path}"]
    out = str(folder / f"{mode}-{path}")
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        if mode == "raise":
            # raised by the next step, before its body (no step waits on the device)
            assert [s for s, _ in r["messages"]] == [3], r["messages"]
            message = r["messages"][0][1]
            if path == "norm":
                assert "gradient norm of step 3 " in message and "is nan" in message, message
            else:
                assert "a0" in message and "rank 1" in message, message
            changed = [i for i, same in enumerate(r["same_after"]) if not same]
            assert not changed, f"parameters or state tensors {changed} changed by a non-finite step"
        else:
            assert r["messages"] == [] and r["skipped"] == 1
            changed = [i for i, same in enumerate(r["same"]) if not same]
            assert not changed, f"parameters or state tensors {changed} changed on a non-finite step"
            # the next finite step trains every parameter (each rank holds rows of each one) ...
            n_params = len(WITH_VECTOR)
            assert not any(r["same_after"][:n_params]), r["same_after"][:n_params]
            # ... and every parameter and state tensor is what a run without the bad step holds
            differ = [i for i, same in enumerate(r["as_if_never"]) if not same]
            assert not differ, f"parameters or state tensors {differ} differ from a run without the bad step"
        if path == "norm":  # every step took its flag from the norm
            assert r["sources"]["own_pass"] == 0 and r["sources"]["gradient_norm"] >= 3, r["sources"]
