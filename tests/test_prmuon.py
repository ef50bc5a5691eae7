"""Periodic Row-wise Muon against a textbook transcription of the paper's Algorithm 1, resume
mid-period, option validation, and sharded RowNorm on spawned gloo ranks."""

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

from dion3_titan.optim.orthogonalize import NSSettings
from dion3_titan.optim.prmuon import STEP_KEY, PeriodicRowwiseMuon
from dion3_titan.optim.rownorm import rownorm_shards
from tests.inputs import random_grads
from tests.reference import textbook_ns
from tests.spawn import spawn

MUON_ABC = (3.4445, -4.7750, 2.0315)
# Muon's NS5 (Jordan et al.'s quintic, 5 standard steps), run by the tests' one NS reference
NS5 = NSSettings("standard", (MUON_ABC,) * 5, restarts=(), dtype=torch.float32)


# ------------------------------------------------------------------ the paper, written plainly


def rownorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(eps)


def algorithm1(w0, grads, *, lr, wd, mu, period, gamma, eps):
    """App. C Alg. 1 on one parameter (2D, or 3D as a stack of independent matrices)."""
    w = w0.clone().reshape(-1, *w0.shape[-2:])
    m = torch.zeros_like(w)
    d_out, d_in = w.shape[-2:]
    scale = math.sqrt(d_out / d_in)  # s(W): Muon's spectral scaling
    for t, g in enumerate(grads):
        m = mu * m + g.reshape(m.shape)
        for b in range(w.shape[0]):
            mt = m[b] if d_out <= d_in else m[b].T  # O(M)
            d = textbook_ns(mt, NS5) if t % period == 0 else gamma * rownorm(mt, eps)
            d = d if d_out <= d_in else d.T  # O^-1
            w[b] = (1 - lr * wd) * w[b] - lr * scale * d
    return w.reshape(w0.shape)


SHAPES = {"wide": (6, 10), "tall": (12, 5), "square": (7, 7), "stack": (3, 9, 4)}
HYPER = dict(lr=0.05, weight_decay=0.1, momentum=0.9, rownorm_gamma=0.2, rownorm_eps=1e-8)


def _grads(shape, steps, seed):
    return random_grads(seed, [shape] * steps)


def _make(params, **over):
    opts = dict(HYPER, ns_dtype="float32", lr_rule="spectral", **over)
    groups = [{"params": params}, {"params": [torch.nn.Parameter(torch.randn(5))], "algorithm": "adamw"}]
    return PeriodicRowwiseMuon(groups, **opts)


def _run(opt, params, grads_per_param, steps):
    for t in range(steps):
        for p, gs in zip(params, grads_per_param):
            p.grad = gs[t].clone()
        opt.param_groups[1]["params"][0].grad = torch.ones(5)
        opt.step()


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("period", [3, 2])
def test_matches_algorithm1(period, algorithm):
    steps = 2 * period + 2  # two full periods, then into a third
    torch.manual_seed(0)
    w0 = {k: torch.randn(s) for k, s in SHAPES.items()}
    grads = {k: _grads(s, steps, i) for i, (k, s) in enumerate(SHAPES.items())}
    params = [torch.nn.Parameter(w.clone()) for w in w0.values()]
    opt = _make(params, refresh_period=period, ns_algorithm=algorithm)
    _run(opt, params, list(grads.values()), steps)
    assert opt.param_groups[0][STEP_KEY] == steps
    tol = 1e-6 if algorithm == "standard" else 1e-5  # Gram NS: same polynomial, other rounding
    for (name, w), p in zip(w0.items(), params):
        ref = algorithm1(
            w,
            grads[name],
            lr=HYPER["lr"],
            wd=HYPER["weight_decay"],
            mu=HYPER["momentum"],
            period=period,
            gamma=HYPER["rownorm_gamma"],
            eps=HYPER["rownorm_eps"],
        )
        torch.testing.assert_close(p.detach(), ref, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def test_first_step_refreshes_and_rownorm_is_gamma_scaled():
    """Step 0 is NS5 (rho_0 = 1); step 1 is a RowNorm step whose rows all have norm gamma*lr*s."""
    w = torch.nn.Parameter(torch.zeros(4, 8))
    opt = _make([w], refresh_period=3, weight_decay=0.0, momentum=0.0)
    w.grad = torch.randn(4, 8)
    opt.step()
    sv = torch.linalg.svdvals(w.detach() / (-HYPER["lr"] * math.sqrt(4 / 8)))
    assert sv.min() > 0.6 and sv.max() < 1.3  # NS5's band around 1, not a row-normalized matrix
    before = w.detach().clone()
    w.grad = torch.randn(4, 8)
    opt.step()
    row_norms = (w.detach() - before).norm(dim=1)
    expected = HYPER["lr"] * math.sqrt(4 / 8) * HYPER["rownorm_gamma"]
    torch.testing.assert_close(row_norms, torch.full((4,), expected), rtol=1e-6, atol=0)


@pytest.mark.parametrize("split_at", [1, 2, 4])
def test_resume_mid_period_is_bit_exact(split_at):
    steps = 7
    torch.manual_seed(1)
    w0 = [torch.randn(s) for s in SHAPES.values()]
    grads = [_grads(s, steps, 10 + i) for i, s in enumerate(SHAPES.values())]

    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = _make(params, refresh_period=3)
    _run(opt, params, grads, steps)

    first = [torch.nn.Parameter(w.clone()) for w in w0]
    opt1 = _make(first, refresh_period=3)
    _run(opt1, first, grads, split_at)
    saved_state = copy.deepcopy(opt1.state_dict())
    saved_weights = [p.detach().clone() for p in first]

    resumed = [torch.nn.Parameter(w) for w in saved_weights]
    opt2 = _make(resumed, refresh_period=5, rownorm_gamma=0.9)  # the checkpoint's K, gamma win
    opt2.param_groups[1]["params"][0].data.copy_(opt1.param_groups[1]["params"][0])
    opt2.load_state_dict(saved_state)
    assert opt2.param_groups[0]["refresh_period"] == 3
    assert opt2.param_groups[0][STEP_KEY] == split_at
    _run(opt2, resumed, [g[split_at:] for g in grads], steps - split_at)
    for a, b in zip(params, resumed):
        assert torch.equal(a.detach(), b.detach())


def test_dcp_flattened_state_dict_resumes_mid_period():
    """torchtitan saves optimizers through DCP's flattened state dict: t and K must survive it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from dion3_titan.optim.routing import build_param_groups

    torch.manual_seed(2)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    a = PeriodicRowwiseMuon(build_param_groups(models[0].named_parameters()), refresh_period=3)
    for _ in range(4):
        for p in models[0].parameters():
            p.grad = torch.randn_like(p)
        a.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    saved = copy.deepcopy(get_optimizer_state_dict(models[0], a, options=options))
    models[1].load_state_dict(models[0].state_dict())
    b = PeriodicRowwiseMuon(build_param_groups(models[1].named_parameters()), refresh_period=7)
    set_optimizer_state_dict(models[1], b, saved, options=options)
    assert (b.param_groups[0][STEP_KEY], b.param_groups[0]["refresh_period"]) == (4, 3)
    for _ in range(4):
        for pa, pb in zip(models[0].parameters(), models[1].parameters()):
            pa.grad = torch.randn_like(pa)
            pb.grad = pa.grad.clone()
        a.step()
        b.step()
    for pa, pb in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize(
    "options, key",
    [
        ({"refresh_period": 0}, "refresh_period"),
        ({"refresh_period": 2.5}, "refresh_period"),
        ({"refresh_period": True}, "refresh_period"),
        ({"rownorm_gamma": 0.0}, "rownorm_gamma"),
        ({"rownorm_gamma": float("inf")}, "rownorm_gamma"),
        ({"rownorm_eps": -1e-8}, "rownorm_eps"),
        ({"fraction": 0.5}, "fraction"),
        ({"flavor": "normuon"}, "flavor"),
        ({"ns_coefficients": "bogus"}, "ns_coefficients"),
        ({"refresh_periode": 3}, "refresh_periode"),
    ],
)
def test_bad_options_raise(options, key):
    with pytest.raises(ValueError, match=key):
        PeriodicRowwiseMuon([torch.nn.Parameter(torch.randn(4, 4))], **options)


@pytest.mark.parametrize("options", [{"split_specs": "pattern=w;chunks=2"}, {"split_heads": 2}], ids=["specs", "heads"])
def test_split_keys_are_refused(options):
    """RowNorm steps work on whole matrices: splitting is refused by name, not ignored."""
    with pytest.raises(ValueError, match=r"split_specs/split_heads are not supported .* name='prmuon'"):
        PeriodicRowwiseMuon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "names": ["w"]}], **options)


def test_bad_group_options_raise():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="param group 0: fraction"):
        PeriodicRowwiseMuon([{"params": [p], "fraction": 0.25}])
    with pytest.raises(ValueError, match="refresh_period"):
        PeriodicRowwiseMuon([{"params": [p], "refresh_period": -1}])


# ------------------------------------------------------------------ sharded, on gloo ranks
def _sharded_run(params, shapes, wrap, steps, start=0, byte_log=None):
    """PRMuon (K = 3) from step counter ``start``; returns the collectives of each step (and
    appends each step's bytes to ``byte_log``)."""
    opt = PeriodicRowwiseMuon(params, refresh_period=3, ns_dtype="float32", **HYPER)
    opt.param_groups[0][STEP_KEY] = start
    g = torch.Generator().manual_seed(5)
    calls = []
    for _ in range(steps):
        for i, (p, shape) in enumerate(zip(params, shapes)):
            p.grad = wrap(torch.randn(shape, generator=g), i)
        before, before_bytes = opt.comm_stats.calls, opt.comm_stats.bytes
        opt.step()
        calls.append(opt.comm_stats.calls - before)
        if byte_log is not None:
            byte_log.append(opt.comm_stats.bytes - before_bytes)
    return calls


FSDP_SHAPES = [(6, 10), (12, 5), (7, 7), (3, 9, 4), (16, 4)]  # (12, 5), (16, 4): tall


def _fsdp_worker(rank: int, world: int, w0: list, out_dir: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    # 1. rownorm_shards on FSDP-style row blocks of W. Oriented (rows = the smaller dim), a wide
    # W keeps whole rows; a tall W's oriented rows are split across the ranks.
    xs, splits = [], []
    for full in w0:
        shard = full.reshape(-1, *full.shape[-2:]).tensor_split(world, dim=1)[rank]
        tall = full.shape[-2] > full.shape[-1]
        xs.append(shard.mT if tall else shard)
        splits.append((dist.group.WORLD,) if tall else ())
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        pieces = rownorm_shards(xs, splits, eps=1e-8)
    finally:
        dist.all_reduce = real
    # 2. the optimizer on DTensor parameters sharded like FSDP2 (Shard(0))
    mesh = init_device_mesh("cpu", (world,))
    params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in w0]
    step_calls = _sharded_run(params, FSDP_SHAPES, lambda g, i: distribute_tensor(g, mesh, [Shard(0)]), 7)
    # 3. bytes at realistic sizes: a RowNorm step moves column statistics, a refresh the matrices
    big = [(512, 128), (128, 512), (4, 256, 64)]
    gen = torch.Generator().manual_seed(9)
    big_params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)])) for s in big]
    byte_log: list[int] = []
    _sharded_run(big_params, big, lambda g, i: distribute_tensor(g, mesh, [Shard(0)]), 2, byte_log=byte_log)
    result = {
        "refresh_bytes": byte_log[0],
        "rownorm_bytes": byte_log[1],
        "pieces": pieces,
        "rownorm_calls": len(calls),
        "step_calls": step_calls,
        "final": [p.detach().full_tensor() for p in params],
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_sharded_matches_single_process_with_one_all_reduce_per_rownorm_step(tmp_path):
    world = 2
    g = torch.Generator().manual_seed(3)
    w0 = [torch.randn(s, generator=g) for s in FSDP_SHAPES]
    spawn(world, _fsdp_worker, w0, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    for rank in range(world):
        assert results[rank]["rownorm_calls"] == 1  # all tall matrices' statistics, one buffer
        # a RowNorm step moves at most 1% of a refresh step's bytes
        assert 0 < results[rank]["rownorm_bytes"] <= 0.01 * results[rank]["refresh_bytes"], results[rank]
    for i, full in enumerate(w0):  # concatenated shards == dense RowNorm (App. B.2, Prop. 3)
        tall = full.shape[-2] > full.shape[-1]
        pieces = [results[r]["pieces"][i] for r in range(world)]
        got = torch.cat([p.mT if tall else p for p in pieces], dim=1)
        oriented = full.reshape(-1, *full.shape[-2:])
        dense = torch.stack([rownorm(m.T, 1e-8).T if tall else rownorm(m, 1e-8) for m in oriented])
        torch.testing.assert_close(got, dense, rtol=1e-6, atol=1e-7)

    params = [torch.nn.Parameter(w.clone()) for w in w0]
    _sharded_run(params, FSDP_SHAPES, lambda g, i: g, 7)
    for rank in range(world):
        # steps 1, 2, 4, 5 are RowNorm steps: exactly one all-reduce each, no matrix moves
        calls = results[rank]["step_calls"]
        assert [calls[t] for t in (1, 2, 4, 5)] == [1, 1, 1, 1], calls
        for got, ref in zip(results[rank]["final"], params):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-6)


# 2D mesh (dp, tp): rows of a matrix split by dp, by tp, or by both (the (16, 4) stack of two
# Shard(0)); a replicated dp dim; an expert stack.
MESH2D_CASES = [
    ((6, 10), "S0 S1"),
    ((12, 4), "S0 S1"),
    ((16, 4), "S0 S0"),
    ((8, 8), "S1 S0"),
    ((4, 12), "R S0"),
    ((3, 8, 4), "S0 S1"),
]


def _placements(code: str) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if c == "R" else Shard(int(c[1])) for c in code.split()]


def _mesh2d_worker(rank: int, world: int, w0: list, out_dir: str) -> None:
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    codes = [c for _, c in MESH2D_CASES]
    params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, _placements(c))) for w, c in zip(w0, codes)]
    shapes = [s for s, _ in MESH2D_CASES]
    calls = _sharded_run(params, shapes, lambda g, i: distribute_tensor(g, mesh, _placements(codes[i])), 4, start=1)
    final = [p.detach().full_tensor() for p in params]
    torch.save({"calls": calls, "final": final}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_sharded_2d_mesh_matches_single_process(tmp_path):
    """Steps 1, 2 RowNorm, 3 refresh, 4 RowNorm on a 2 x 2 (dp, tp) mesh of 4 gloo ranks."""
    g = torch.Generator().manual_seed(4)
    w0 = [torch.randn(s, generator=g) for s, _ in MESH2D_CASES]
    spawn(4, _mesh2d_worker, w0, str(tmp_path))
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    _sharded_run(params, [s for s, _ in MESH2D_CASES], lambda g, i: g, 4, start=1)
    for rank in range(4):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        # a RowNorm step: one packed all-reduce per mesh dim that splits rows (dp, tp)
        assert [res["calls"][t] for t in (0, 1, 3)] == [2, 2, 2], res["calls"]
        for got, ref in zip(res["final"], params):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-6)
