"""A captured optimizer step gives bit-identical parameters to eager steps (1 GPU, and 2 GPUs
with FSDP2 over NCCL), with a live learning-rate schedule and live weight-decay changes; a
non-finite gradient is handled alike in both paths (nonfinite = "skip" / "raise", optim/nonfinite.py)."""

import copy

import pytest
import torch
import torch.nn as nn

from tests.inputs import random_grads
from tests.optimizers import normuon_quarter
from tests.spawn import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SHAPES = [(64, 256), (64, 256), (256, 64), (128, 128), (4, 32, 96), (256,)]


def _model(device):
    g = torch.Generator().manual_seed(0)
    m = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])
    return m.to(device)


def _grads(step, device):
    return [g.to(device) for g in random_grads(100 + step, SHAPES)]


def _train(model, graphed: bool, fraction: float, flavor: str, steps: int, device, wd_changes=None):
    """Final parameters and the number of graph captures. ``wd_changes``: {step: (matrix
    weight decay, AdamW weight decay)}, set before that step."""
    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    mats = [p for p in model if p.ndim >= 2]
    vecs = [p for p in model if p.ndim < 2]
    opt = Dion3(
        [{"params": mats}, {"params": vecs, "algorithm": "adamw"}],
        lr=0.02,
        fraction=fraction,
        flavor=flavor,
        weight_decay=0.1,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    runner = GraphedOptimizer(opt, warmup_steps=3) if graphed else opt
    captures, graph = 0, None
    for step in range(steps):
        if step in (wd_changes or {}):
            for group, wd in zip(opt.param_groups, wd_changes[step]):
                group["weight_decay"] = wd
        for p, g in zip(model, _grads(step, device)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g)
        runner.step()
        sched.step()
        # a new graph: this step captured one (a re-capture follows one eager step)
        if graphed and runner.graph is not None and runner.graph is not graph:
            captures, graph = captures + 1, runner.graph
    torch.cuda.synchronize()
    if graphed:
        runner.release()
    return [p.detach().clone() for p in model], captures


@pytest.mark.parametrize("fraction,flavor", [(1.0, "muon"), (0.25, "normuon")])
def test_graph_equals_eager_one_gpu(fraction, flavor):
    base = _model("cuda")
    eager, _ = _train(copy.deepcopy(base), False, fraction, flavor, 20, "cuda")
    graphed, _ = _train(copy.deepcopy(base), True, fraction, flavor, 20, "cuda")
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


def test_live_weight_decay_change_under_graph():
    """Weight decay changed after capture: the matrices' value is read live (no re-capture)
    unless it turns on or off (without it the update leaves unselected rows unread), the AdamW
    group's is baked into the graph (torch's AdamW takes it as a float), so changing it
    re-captures. All give the eager run's bits."""
    changes = {6: (0.3, 0.1), 9: (0.3, 0.05), 12: (0.0, 0.05), 15: (0.0, 0.0), 17: (0.2, 0.0)}
    base = _model("cuda")
    eager, _ = _train(copy.deepcopy(base), False, 0.25, "normuon", 20, "cuda", changes)
    graphed, captures = _train(copy.deepcopy(base), True, 0.25, "normuon", 20, "cuda", changes)
    # the first capture; the AdamW changes at steps 9 and 15; the matrices' off at 12, on at 17
    assert captures == 5
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    unchanged, _ = _train(copy.deepcopy(base), False, 0.25, "normuon", 20, "cuda")
    assert all(not torch.equal(a, b) for a, b in zip(eager, unchanged))  # the changes took effect


def _fsdp_worker(rank, world, out_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    results = []
    for graphed in (False, True):
        model = _model(f"cuda:{rank}")
        fully_shard(model)
        params = list(model)
        _, runner = normuon_quarter(params, graphed)
        for step in range(20):
            for p, g in zip(params, _grads(step, f"cuda:{rank}")):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements)  # new tensors each step
            runner.step()
        torch.cuda.synchronize()
        results.append([p.full_tensor().cpu() for p in params])
        if graphed:
            runner.release()
    if rank == 0:
        torch.save(results, out_path)


@pytest.mark.multigpu
def test_graph_equals_eager_fsdp_two_gpus(tmp_path):
    out = tmp_path / "g.pt"
    spawn(2, _fsdp_worker, str(out), backend="nccl")
    eager, graphed = torch.load(out)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ non-finite gradients
BAD_STEP = 5  # after the capture (warmup 3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().reshape(-1).clone().view(torch.uint8)


def _snapshot(opt, params) -> list[torch.Tensor]:
    """Every parameter and every state tensor (momentum, NorMuon variance, AdamW's)."""
    torch.cuda.synchronize()
    return [_bits(p) for p in params] + [_bits(v) for p in params for v in opt.state[p].values()]


def _nonfinite_run(params, graphed, policy, flavor, fraction, steps, skip_bad_step=False):
    """Train ``steps`` steps; step BAD_STEP gets a NaN in the first gradient (or, with
    ``skip_bad_step``, is not taken at all). Returns (params at the end, the exception and the
    step it came at, whether the bad step left everything bit-identical, skipped steps)."""
    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    device = params[0].device
    opt = Dion3(
        [
            {"params": params[:-1], "names": [f"m{i}" for i in range(len(params) - 1)]},
            {"params": params[-1:], "algorithm": "adamw", "names": ["vec"]},
        ],
        lr=0.02,
        fraction=fraction,
        flavor=flavor,
        weight_decay=0.1,
        nonfinite=policy,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    runner = GraphedOptimizer(opt, warmup_steps=3) if graphed else opt
    raised, same = None, None
    for step in range(steps):
        if step == BAD_STEP and skip_bad_step:
            continue
        for p, g in zip(params, _grads(step, device)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g)  # in place: where the captured step reads it
        if step == BAD_STEP:
            params[0].grad.view(-1)[7] = float("nan")
            before = _snapshot(opt, params)
        try:
            runner.step()
        except FloatingPointError as exc:
            raised = (step, str(exc))
            break
        if step == BAD_STEP:
            same = all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt, params)))
        else:
            sched.step()  # a run that never took the bad step has the same schedule
    if raised is not None:
        same = all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt, params)))
    skipped = opt.skipped_steps if raised is None else None
    if graphed:
        runner.release()
    return [p.detach().clone() for p in params], raised, same, skipped


@pytest.mark.parametrize("fraction,flavor", [(1.0, "muon"), (0.25, "normuon")])
@pytest.mark.parametrize("graphed", [False, True])
def test_nonfinite_skip_one_gpu(graphed, fraction, flavor):
    """ "skip": the bad step leaves every parameter and state tensor bit-identical, is counted,
    and the run then equals one that never took that step (graph and eager alike)."""
    base = _model("cuda")
    got, raised, same, skipped = _nonfinite_run(list(copy.deepcopy(base)), graphed, "skip", flavor, fraction, 10)
    assert raised is None and same and skipped == 1
    ref, _, _, ref_skipped = _nonfinite_run(
        list(copy.deepcopy(base)), graphed, "skip", flavor, fraction, 10, skip_bad_step=True
    )
    assert ref_skipped == 0
    for a, b, p0 in zip(got, ref, base):
        assert torch.equal(a, b) and not torch.equal(a, p0)


@pytest.mark.parametrize("graphed", [False, True])
def test_nonfinite_raise_one_gpu(graphed):
    """ "raise": eager and replayed alike raise at the next step() (no step waits on the
    device; the host reads the bad step's flag then); nothing of the bad step is applied."""
    base = _model("cuda")
    _, raised, same, _ = _nonfinite_run(list(copy.deepcopy(base)), graphed, "raise", "normuon", 0.25, 10)
    assert raised is not None and raised[0] == BAD_STEP + 1, raised
    assert "['m0']" in raised[1], raised[1]
    assert same


def _fsdp_nonfinite_worker(rank, world, policy, out_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    device = f"cuda:{rank}"
    model = _model(device)
    fully_shard(model)
    params = list(model)
    opt = Dion3(
        [
            {"params": params[:-1], "names": [f"m{i}" for i in range(len(params) - 1)]},
            {"params": params[-1:], "algorithm": "adamw", "names": ["vec"]},
        ],
        lr=0.02,
        fraction=0.25,
        flavor="normuon",
        weight_decay=0.1,
        nonfinite=policy,
    )
    runner = GraphedOptimizer(opt, warmup_steps=3)
    result = {"raised": None, "same": None}
    for step in range(8):
        for p, g in zip(params, _grads(step, device)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)  # new tensors each step
        if step == BAD_STEP:
            if rank == 1:
                params[0].grad.to_local().view(-1)[0] = float("nan")
            before = _snapshot(opt, params)
        try:
            runner.step()
        except FloatingPointError as exc:
            result["raised"] = (step, str(exc))
            break
        if step == BAD_STEP:
            result["same"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt, params)))
    if result["raised"] is not None:
        result["same"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt, params)))
    else:
        result["skipped"] = opt.skipped_steps
    runner.release()
    torch.save(result, f"{out_path}.{rank}")


@pytest.mark.multigpu
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_fsdp_two_gpus(tmp_path, policy):
    """A NaN on rank 1 only: every rank skips (or raises, naming rank 1's parameter, at the
    next step) and every rank's shards and state stay bit-identical."""
    out = tmp_path / "r"
    spawn(2, _fsdp_nonfinite_worker, policy, str(out), backend="nccl")
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        assert r["same"], rank
        if policy == "skip":
            assert r["raised"] is None and r["skipped"] == 1
        else:
            assert r["raised"][0] == BAD_STEP + 1 and "m0 (rank 1)" in r["raised"][1], r["raised"]


# ------------------------------------------------------------------------------ a given gradient norm
def _norm_run(params, graphed, steps, inf_norm_step=None, nan_grad_step=None, norm_until=None):
    """Train ``steps`` steps, each given the gradients' total norm (as torchtitan's clipping
    hands it over) until ``norm_until``, after that none (the own pass). ``inf_norm_step`` is
    given an inf norm over finite gradients; ``nan_grad_step`` gets a NaN in the first gradient
    after its norm was taken.
    Returns (params, whether the inf-norm step left everything bit-identical, skipped steps,
    flag sources, graphs captured)."""
    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    device = params[0].device
    opt = Dion3(
        [
            {"params": params[:-1], "names": [f"m{i}" for i in range(len(params) - 1)]},
            {"params": params[-1:], "algorithm": "adamw", "names": ["vec"]},
        ],
        lr=0.02,
        fraction=0.25,
        flavor="normuon",
        weight_decay=0.1,
        nonfinite="skip",
    )
    runner = GraphedOptimizer(opt, warmup_steps=3) if graphed else opt
    same, captures, graph = None, 0, None
    for step in range(steps):
        for p, g in zip(params, _grads(step, device)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g)  # in place: where the captured step reads it
        if norm_until is None or step < norm_until:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            runner.use_gradient_norm(torch.full_like(norm, float("inf")) if step == inf_norm_step else norm)
        if step == nan_grad_step:  # after the norm: a given norm does not see it
            params[0].grad.view(-1)[7] = float("nan")
        if step == inf_norm_step:
            before = _snapshot(opt, params)
        runner.step()
        if step == inf_norm_step:
            same = all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt, params)))
        if graphed and runner.graph is not None and runner.graph is not graph:
            captures, graph = captures + 1, runner.graph
    torch.cuda.synchronize()
    skipped, sources = opt.skipped_steps, opt.nonfinite.flag_sources
    if graphed:
        runner.release()
    return [p.detach().clone() for p in params], same, skipped, sources, captures


def test_given_norm_under_graph_skips_an_inf_norm_and_equals_eager():
    """Captured with the norm path, a replay given an inf norm (finite gradients) skips the
    step bit for bit, replays given finite norms apply theirs, and the run equals the eager
    one bit for bit; every step's flag came from the norm."""
    base = _model("cuda")
    eager, e_same, e_skipped, e_sources, _ = _norm_run(list(copy.deepcopy(base)), False, 10, inf_norm_step=BAD_STEP)
    got, same, skipped, sources, captures = _norm_run(list(copy.deepcopy(base)), True, 10, inf_norm_step=BAD_STEP)
    assert captures == 1
    assert e_same and same and e_skipped == skipped == 1
    assert e_sources == sources == {"gradient_norm": 10, "own_pass": 0}
    for a, b, p0 in zip(got, eager, base):
        assert torch.equal(a, b) and not torch.equal(a, p0)


def test_given_norm_under_graph_makes_no_pass():
    """A replay given a finite norm reads no gradient for its flag: a NaN planted in a
    gradient goes through (the own pass would have skipped the step)."""
    base = _model("cuda")
    _, _, skipped, sources, captures = _norm_run(list(copy.deepcopy(base)), True, 8, nan_grad_step=BAD_STEP)
    assert captures == 1 and skipped == 0 and sources == {"gradient_norm": 8, "own_pass": 0}


def test_a_step_without_a_norm_after_a_norm_capture_recaptures():
    """Captured with the norm path, then steps given no norm: the graph is captured again for
    the own pass (after one eager step), which catches a NaN gradient; bit for bit the eager run."""
    base = _model("cuda")
    kw = {"nan_grad_step": 8, "norm_until": 6}
    eager, _, e_skipped, e_sources, _ = _norm_run(list(copy.deepcopy(base)), False, 11, **kw)
    got, _, skipped, sources, captures = _norm_run(list(copy.deepcopy(base)), True, 11, **kw)
    assert captures == 2
    assert e_skipped == skipped == 1
    assert e_sources == sources == {"gradient_norm": 6, "own_pass": 5}
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


def _new_grads_run(params, graphed: bool, steps: int, shift_odd_steps: bool):
    """Every step: ``zero_grad(set_to_none=True)``, then each gradient in new memory (earlier
    steps' buffers kept, so no address comes back), with its norm given. ``shift_odd_steps``:
    on odd steps the gradients start one float into their buffer, a distance the captured
    tables' alignment cannot take (those steps copy). Returns the parameters and, per replay,
    how many gradients were copied."""
    device = params[0].device
    _, runner = normuon_quarter(params, graphed)
    buffers, copied = [], []
    for step in range(steps):
        runner.zero_grad(set_to_none=True)
        shift = step % 2 if shift_odd_steps else 0
        for p, g in zip(params, _grads(step, device)):
            buf = torch.empty(g.numel() + 1, device=device)
            p.grad = buf[shift : shift + g.numel()].view_as(g).copy_(g)
            buffers.append(buf)
        runner.use_gradient_norm(torch.nn.utils.get_total_norm([p.grad for p in params]))
        runner.step()
        if graphed and runner.graph is not None:
            copied.append(runner.copied_grads)
    torch.cuda.synchronize()
    if graphed:
        runner.release()
    return [p.detach().clone() for p in params], copied


@pytest.mark.parametrize("shift_odd_steps", [False, True])
def test_new_gradient_tensors_are_read_where_they_are(shift_odd_steps):
    """Gradients in new tensors every step (set to None, as torchtitan's zero_grad does): a
    replay reads the matrices' gradients where they now are and copies only AdamW's, and when a
    gradient's new place breaks the captured tables' alignment it is copied instead; bit for
    bit the eager run either way."""
    base = _model("cuda")
    eager, _ = _new_grads_run(list(copy.deepcopy(base)), False, 10, shift_odd_steps)
    got, copied = _new_grads_run(list(copy.deepcopy(base)), True, 10, shift_odd_steps)
    matrices = sum(1 for p in base if p.ndim >= 2)
    # 3 eager steps, then the capture (its own gradients: nothing to copy) and 6 replays
    if shift_odd_steps:  # captured on odd step 3: even replays copy every gradient, odd ones AdamW's
        assert copied == [0] + [matrices + 1, 1] * 3, copied
    else:
        assert copied == [0] + [1] * 6, copied  # AdamW's vector alone
    for a, b, p0 in zip(got, eager, base):
        assert torch.equal(a, b) and not torch.equal(a, p0)


def _no_norm_run(params, graphed: bool, steps: int, spread: bool):
    """Every step: ``zero_grad(set_to_none=True)``, then each gradient a new tensor (earlier
    steps' kept, so no address comes back) and no gradient norm given: the step makes its own
    finiteness pass. ``spread``: the step's gradients lie in one new buffer with a gap between
    them that grows every step, so their distances within a shape group are new at every step,
    the capture step's included (no eager step built a cached kernel table for them); else
    each is a tensor of its own, where the allocator puts it. Step BAD_STEP (a replay) gets a
    NaN in the first gradient. Returns the parameters, per replay how many gradients were
    copied, whether the capture read every matrix's gradient through movable tables, and
    the skipped steps."""
    device = params[0].device
    opt, runner = normuon_quarter(params, graphed, nonfinite="skip")
    buffers, copied, covered = [], [], None
    for step in range(steps):
        runner.zero_grad(set_to_none=True)
        grads = _grads(step, device)
        if step == BAD_STEP:
            grads[0].view(-1)[7] = float("nan")
        if spread:
            gap = 4 * (step + 1)  # floats: 16-byte multiples
            buf = torch.empty(sum(g.numel() + gap for g in grads), device=device)
            at = 0
            for p, g in zip(params, grads):
                at += gap
                p.grad = buf[at : at + g.numel()].view_as(g).copy_(g)
                at += g.numel()
            buffers.append(buf)
        else:
            for p, g in zip(params, grads):
                p.grad = g  # a new tensor, made by this step's _grads
            buffers.append(grads)
        runner.step()
        if graphed and runner.graph is not None:
            copied.append(runner.copied_grads)
            if covered is None:
                covered = all(runner.moving_gradients.covers(p) for p in params[:-1])
    torch.cuda.synchronize()
    skipped = opt.skipped_steps
    if graphed:
        runner.release()
    return [p.detach().clone() for p in params], copied, covered, skipped


@pytest.mark.parametrize("spread", [False, True])
def test_new_gradient_tensors_without_a_norm_are_copied(spread):
    """No gradient norm given (standalone use, torchtitan with max_norm <= 0) and gradients in
    new tensors every step, the capture step's too: the capture reads the matrices' gradients
    through movable tables all the same (none of its kernel tables depends on where the
    gradients were at an eager step), and every replay copies every gradient into the
    captured tensors, where the step's own finiteness pass reads them (a NaN on a replay is
    skipped as eagerly). Bit for bit the eager run."""
    base = _model("cuda")
    eager, _, _, e_skipped = _no_norm_run(list(copy.deepcopy(base)), False, 10, spread)
    got, copied, covered, skipped = _no_norm_run(list(copy.deepcopy(base)), True, 10, spread)
    # 3 eager steps, then the capture (its own gradients: nothing to copy) and 6 replays
    assert copied == [0] + [len(SHAPES)] * 6, copied
    assert covered
    assert e_skipped == skipped == 1
    for a, b, p0 in zip(got, eager, base):
        assert torch.equal(a, b) and not torch.equal(a, p0)
