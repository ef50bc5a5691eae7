"""Dion3 against the textbook (tests/dist_reference.py) where no other test compares values:
replicated (DDP-style) matrices, tensor parallelism with local selection at f = 1/4, random
selection on 2 ranks, ``megabatch = false``, and NorMuon at f < 1 on one process. The
distributed cases share one 2-rank gloo run."""

import math

import pytest
import torch
import torch.nn as nn

from tests import dist_reference
from tests.dist_reference import TextbookDion3
from tests.spawn import spawn
from tests.test_dist_fsdp import SHAPES, Bag, grads_for
from tests.test_dist_parallel import Block, _train

pytestmark = pytest.mark.timeout(600)

LR, WD, STEPS = 0.05, 0.1, 3


def _dion3(params, **options):
    from dion3_titan import Dion3

    opts = {"lr": LR, "ns_dtype": "float32", "weight_decay": WD, "backend": "torch", **options}
    return Dion3([{"params": list(params)}], **opts)


def _textbook(init, grads, chunks, wd=WD, **options):
    """The textbook's weights after ``grads`` (a list per step), from ``init``."""
    ref = TextbookDion3([w.shape for w in init], lr=LR, wd=wd, chunks=chunks, **options)
    weights = [w.clone() for w in init]
    for g in grads:
        ref.step(weights, g)
    return weights


def _replicated(fraction, flavor):
    """Every matrix whole on both ranks (DDP): each rank orthogonalizes its share of a shape
    group and the results are all-gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    full = [p.detach().clone() for p in Bag(2).parameters()]  # two members per shape group
    params = [nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()])) for w in full]
    opt = _dion3(params, fraction=fraction, flavor=flavor)
    shapes = [tuple(w.shape) for w in full]
    for step in range(STEPS):
        for p, g in zip(params, grads_for(step, shapes)):
            p.grad = distribute_tensor(g, mesh, [Replicate()])
        opt.step()
    owners = {type(sg.exchange).__name__ for sg in opt._groups}
    want = _textbook(full, [grads_for(s, shapes) for s in range(STEPS)], None, fraction=fraction, flavor=flavor)
    return {"got": [p.full_tensor() for p in params], "want": want, "exchanges": sorted(owners)}


def _tensor_parallel(fraction, flavor):
    """TP on 2 ranks, local scope: colwise linears (rows sharded) select in each rank's rows,
    the rowwise one (columns sharded) in its whole rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = Block()
    init = [p.detach().clone() for p in model.parameters()]
    parallelize_module(
        model,
        mesh,
        {
            "up": ColwiseParallel(),
            "gate": ColwiseParallel(),
            "down": RowwiseParallel(),
            "sq": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    opt = _dion3(model.parameters(), fraction=fraction, flavor=flavor, selection_scope="local")
    grads = _train(model, opt, STEPS, 0)  # the same batch on both TP ranks
    rowwise = [p.placements[0].dim == 1 for p in model.parameters()]
    want = []
    for i, w in enumerate(init):  # a column-sharded matrix has whole rows: no chunks
        chunks = None if rowwise[i] else 2
        want += _textbook([w], [[g[i]] for g in grads], chunks, fraction=fraction, flavor=flavor)
    return {"got": [p.full_tensor() for p in model.parameters()], "want": want, "rowwise": rowwise}


def _random(scope):
    """selection = "random" under FSDP on 2 ranks, no weight decay: the rows a step moves are
    the rows it selected. Returns the weights after every step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = Bag(1)
    init = [p.detach().clone() for p in model.parameters()]
    fully_shard(model)
    params = list(model.parameters())
    opt = _dion3(params, fraction=0.25, flavor="normuon", selection="random", selection_scope=scope, weight_decay=0.0)
    shapes = [tuple(w.shape) for w in init]
    history = [init]
    for step in range(STEPS):
        for p, g in zip(params, grads_for(step, shapes)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
        history.append([p.full_tensor() for p in params])
    return {"history": history}


def _no_megabatch(fraction, flavor, scope):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = Bag(2)
    init = [p.detach().clone() for p in model.parameters()]
    fully_shard(model)
    params = list(model.parameters())
    opt = _dion3(params, fraction=fraction, flavor=flavor, selection_scope=scope, megabatch=False)
    shapes = [tuple(w.shape) for w in init]
    for step in range(STEPS):
        for p, g in zip(params, grads_for(step, shapes)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    want = _textbook(
        init,
        [grads_for(s, shapes) for s in range(STEPS)],
        None if scope == "global" else 2,
        fraction=fraction,
        flavor=flavor,
    )
    return {"got": [p.full_tensor() for p in params], "want": want, "groups": len(opt._groups)}


def _worker(rank, world, out_path):
    results = {
        "replicated": [_replicated(0.25, "normuon"), _replicated(1.0, "muon")],
        "tp": [_tensor_parallel(0.25, "muon"), _tensor_parallel(0.25, "normuon")],
        "random": {scope: _random(scope) for scope in ("local", "global")},
        "no_megabatch": [_no_megabatch(0.25, "normuon", "global"), _no_megabatch(0.25, "muon", "local")],
    }
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("textbook") / "r.pt"
    spawn(2, _worker, str(out))
    return torch.load(out)


def _assert_equal(got, want, what):
    assert len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (what, i)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (what, i, (a - b).abs().max())


def test_replicated_matrices_match_the_textbook(results):
    for r, cfg in zip(results["replicated"], ["f0.25-normuon", "f1-muon"]):
        assert r["exchanges"] == ["ReplicatedExchange"], r["exchanges"]  # both ranks share the NS work
        _assert_equal(r["got"], r["want"], cfg)


def test_tensor_parallel_local_scope_matches_the_textbook(results):
    for r, cfg in zip(results["tp"], ["f0.25-muon", "f0.25-normuon"]):
        assert r["rowwise"] == [False, False, True, False]  # up, gate, down, sq
        _assert_equal(r["got"], r["want"], cfg)


def test_megabatch_off_matches_the_textbook(results):
    for r, cfg in zip(results["no_megabatch"], ["f0.25-normuon-global", "f0.25-muon-local"]):
        assert r["groups"] > len({s for s in SHAPES.values()})  # really more batches than shapes
        _assert_equal(r["got"], r["want"], cfg)


@pytest.mark.parametrize("scope", ["local", "global"])
def test_random_selection_on_two_ranks_matches_the_textbook(results, scope):
    """Each step moves exactly k rows of each FSDP chunk (local) or of each matrix (global),
    not the l1 choice, and the moved rows get the textbook update of those rows."""
    history = results["random"][scope]["history"]
    shapes = [tuple(w.shape) for w in history[0]]
    picked = []  # per step: the moved rows of each 2D matrix, in the textbook's order
    for before, after in zip(history, history[1:]):
        rows = []
        for w0, w1 in zip(before, after):
            moved = (w1 != w0).reshape(-1, *w0.shape[-2:]).any(dim=-1)
            rows += [m.nonzero().squeeze(1) for m in moved]
        picked.append(rows)
    # (rows, sharded) per 2D matrix: FSDP shards a 2D weight's rows, a 3D stack along its batch
    matrices = [(s[-2], len(s) == 2) for s in shapes for _ in range(s[0] if len(s) == 3 else 1)]
    for step, rows in enumerate(picked):
        assert len(rows) == len(matrices)
        for i, (r, (n, sharded)) in enumerate(zip(rows, matrices)):
            if scope == "global" or not sharded:
                assert len(r) == math.ceil(0.25 * n), (step, i, r)
            else:
                sizes = dist_reference.chunk_sizes(n, 2)
                per_chunk = [int(((r >= sum(sizes[:c])) & (r < sum(sizes[: c + 1]))).sum()) for c in range(2)]
                k = math.ceil(0.25 * max(sizes))
                assert per_chunk == [min(k, s) for s in sizes], (step, i, per_chunk)

    # the textbook fed the same rows (its own l1 choice recorded to show they differ)
    l1_choice, given = dist_reference.select, iter([r for rows in picked for r in rows])
    differs = []

    def select(m, fraction, chunks):
        mine = next(given)
        differs.append(not torch.equal(l1_choice(m, fraction, chunks), mine))
        return mine

    grads = [grads_for(s, shapes) for s in range(STEPS)]
    try:
        dist_reference.select = select
        chunks = None if scope == "global" else 2
        want = _textbook(history[0], grads, chunks, wd=0.0, fraction=0.25, flavor="normuon")
    finally:
        dist_reference.select = l1_choice
    assert any(differs)
    _assert_equal(history[-1], want, scope)


@pytest.mark.parametrize("scope", ["local", "global"])
def test_normuon_below_one_matches_the_textbook_on_one_process(scope):
    """NorMuon at f = 1/4 (its second moment is kept for the selected rows only) with weight
    decay, on plain tensors."""
    params = list(Bag(1).parameters())
    init = [p.detach().clone() for p in params]
    shapes = [tuple(w.shape) for w in init]
    opt = _dion3(params, fraction=0.25, flavor="normuon", selection_scope=scope)
    for step in range(STEPS):
        for p, g in zip(params, grads_for(step, shapes)):
            p.grad = g
        opt.step()
    want = _textbook(init, [grads_for(s, shapes) for s in range(STEPS)], None, fraction=0.25, flavor="normuon")
    _assert_equal([p.detach() for p in params], want, scope)
