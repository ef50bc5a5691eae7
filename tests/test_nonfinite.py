"""A non-finite gradient on one process (optim/nonfinite.py): "skip" leaves every parameter
and every state tensor bit for bit as it was and the run continues as if that step had never
been taken; "raise" names the parameter and applies nothing. Checked for the eager step and for the step
body a CUDA graph captures: neither waits on the device, so a step's flag is read (and "raise"
raises) when the next step starts."""

import pytest
import torch

from dion3_titan import Dion3
from dion3_titan.optim.prmuon import PeriodicRowwiseMuon
from tests.inputs import randn
from tests.test_dion3_core import NAMES, SHAPES, make_params, oriented, random_grads

pytestmark = pytest.mark.timeout(300)

ADAMW_SHAPES = {"emb": (10, 4), "bias": (16,)}
BAD_STEP = 3


def _build(cls, policy, **options):
    params = make_params(7)
    g = torch.Generator().manual_seed(8)
    extra = [torch.nn.Parameter(randn(s, g)) for s in ADAMW_SHAPES.values()]
    opt = cls(
        [
            {"params": params, "names": NAMES},
            {"params": extra, "algorithm": "adamw", "names": list(ADAMW_SHAPES), "lr": 0.01},
        ],
        lr=0.02,
        weight_decay=0.1,
        nonfinite=policy,
        ns_dtype="float32",
        **options,
    )
    opt.track_selection()  # the selection stamps and their step counter are state too
    return opt


def _set_grads(opt, step, poison=None):
    params = [p for g in opt.param_groups for p in g["params"]]
    names = NAMES + list(ADAMW_SHAPES)
    grads = random_grads(step, SHAPES + list(ADAMW_SHAPES.values()))
    for p, name, gr in zip(params, names, grads):
        if name == poison:
            gr.view(-1)[gr.numel() // 2] = float("nan") if step % 2 else float("inf")
        p.grad = gr


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).clone().view(torch.uint8)


def _snapshot(opt) -> dict[str, torch.Tensor]:
    """Every parameter, every state tensor, the selection stamps and the host counters."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for name, p in zip(group["names"], group["params"]):
            out[name] = _bits(p)
            for key, value in opt.state[p].items():
                out[f"{name}.{key}"] = _bits(value)
        for key in ("selection_step", "prmuon_step"):
            if key in group:
                out[f"group{gi}.{key}"] = torch.tensor([group[key]])
    for i, stamps in enumerate(opt.observer.last_selected.values()):
        out[f"stamps{i}"] = _bits(stamps)
    out["step_t"] = _bits(opt.observer.step_t)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert not changed, f"changed on a non-finite step: {changed}"


def _deferred_step(opt) -> None:
    """What GraphedOptimizer does around a replay, with the captured body run directly."""
    opt.nonfinite.resolve()
    opt.load_hyperparameters()
    opt.step_body()
    opt.nonfinite.issued()


def _run(opt, steps, path, poison=None, bad_step=BAD_STEP):
    """Steps 0..steps-1; ``bad_step`` gets a non-finite gradient in ``poison`` (None: that
    step is not taken at all)."""
    step_fn = opt.step if path == "eager" else (lambda: _deferred_step(opt))
    for step in range(steps):
        if step == bad_step and poison is None:
            continue
        _set_grads(opt, step, poison if step == bad_step else None)
        step_fn()


@pytest.mark.parametrize("path", ["eager", "deferred"])
@pytest.mark.parametrize("poison", ["tall", "emb"])
@pytest.mark.parametrize("flavor,fraction", [("normuon", 0.25), ("normuon", 1.0), ("muon", 0.25), ("muon", 1.0)])
def test_skip_is_bit_identical_and_as_if_never_taken(flavor, fraction, poison, path):
    opt = _build(Dion3, "skip", flavor=flavor, fraction=fraction)
    _run(opt, BAD_STEP, path)
    before = _snapshot(opt)
    _set_grads(opt, BAD_STEP, poison)
    (opt.step if path == "eager" else lambda: _deferred_step(opt))()
    assert opt.skipped_steps == 1
    _assert_same(before, _snapshot(opt))
    # the run goes on exactly as one that never took the bad step
    for step in range(BAD_STEP + 1, BAD_STEP + 3):
        _set_grads(opt, step)
        (opt.step if path == "eager" else lambda: _deferred_step(opt))()
    ref = _build(Dion3, "skip", flavor=flavor, fraction=fraction)
    _run(ref, BAD_STEP + 3, path)
    _assert_same(_snapshot(ref), _snapshot(opt))
    assert ref.skipped_steps == 0
    moved = _snapshot(ref)
    assert not torch.equal(moved["tall"], before["tall"])
    assert not torch.equal(moved["emb.exp_avg"], before["emb.exp_avg"])


@pytest.mark.parametrize("poison", ["tall", "emb"])
@pytest.mark.parametrize("flavor,fraction", [("normuon", 0.25), ("muon", 1.0)])
def test_raise_names_the_parameter_and_applies_nothing(flavor, fraction, poison):
    opt = _build(Dion3, "raise", flavor=flavor, fraction=fraction)
    _run(opt, BAD_STEP, "eager")
    before = _snapshot(opt)
    _set_grads(opt, BAD_STEP, poison)
    opt.step()  # a step never waits on the device: its flag is read when the next one starts
    _assert_same(before, _snapshot(opt))
    _set_grads(opt, BAD_STEP + 1)
    with pytest.raises(FloatingPointError, match=rf"\['{poison}'\]"):
        opt.step()
    _assert_same(before, _snapshot(opt))


@pytest.mark.parametrize("flavor,fraction", [("normuon", 0.25), ("muon", 1.0)])
def test_deferred_raise_comes_at_the_next_step(flavor, fraction):
    """The captured body cannot look at its flag: the bad step is applied as a no-op, and the
    next step raises before doing anything."""
    opt = _build(Dion3, "raise", flavor=flavor, fraction=fraction)
    _run(opt, BAD_STEP, "deferred")
    before = _snapshot(opt)
    _set_grads(opt, BAD_STEP, "square")
    _deferred_step(opt)  # no host sync, no exception yet
    _assert_same(before, _snapshot(opt))
    _set_grads(opt, BAD_STEP + 1)
    with pytest.raises(FloatingPointError, match=r"\['square'\]"):
        _deferred_step(opt)
    _assert_same(before, _snapshot(opt))


def test_random_selection_seed_rolls_back():
    """selection = "random" seeds each step from a host counter; a skipped step gives it back."""
    opt = _build(Dion3, "skip", fraction=0.25, selection="random")
    ref = _build(Dion3, "skip", fraction=0.25, selection="random")
    _run(opt, BAD_STEP + 3, "eager", poison="stack")
    _run(ref, BAD_STEP + 3, "eager")
    assert opt.skipped_steps == 1
    _assert_same(_snapshot(ref), _snapshot(opt))


@pytest.mark.parametrize("bad_step", [2, 3])  # a refresh step (counter 2) and a RowNorm step
def test_prmuon_skip_on_refresh_and_rownorm_steps(bad_step):
    opt = _build(PeriodicRowwiseMuon, "skip", refresh_period=2)
    ref = _build(PeriodicRowwiseMuon, "skip", refresh_period=2)
    _run(opt, bad_step, "eager")
    before = _snapshot(opt)
    _set_grads(opt, bad_step, "wide")
    opt.step()
    assert opt.skipped_steps == 1  # reads the step's flag: the host's step counter rolls back
    _assert_same(before, _snapshot(opt))
    for step in range(bad_step + 1, bad_step + 3):
        _set_grads(opt, step)
        opt.step()
    _run(ref, bad_step + 3, "eager", bad_step=bad_step)
    assert opt.skipped_steps == 1
    _assert_same(_snapshot(ref), _snapshot(opt))


# ------------------------------------------------------------------------------ non-finite NS results
class CorruptOneGram:
    """The torch backend, except that the first ``times`` Gram products X X^T of side ``side``
    get an inf in matrix ``which`` of the batch."""

    def __init__(self, side: int, which: int, times: int) -> None:
        from dion3_titan.kernels.torch_ops import TorchOps

        self.ops, self.side, self.which, self.times = TorchOps(), side, which, times
        self.name = "corrupt"

    def sym_mm(self, a, b, zero_from=None):
        r = self.ops.sym_mm(a, b, zero_from)
        if self.times > 0 and r.shape[-1] == self.side:
            self.times -= 1
            r = r.clone()
            r[min(self.which, r.shape[0] - 1), 0, 0] = float("inf")
        return r

    def __getattr__(self, name):  # every other op: the torch backend's
        return getattr(self.ops, name)


class FlaggingCorruptOneGram(CorruptOneGram):
    """``CorruptOneGram`` with a checked product (``Backend.mm_checked``) as a kernel's epilogue
    would make it: the product, and a flag per matrix whose result is not finite."""

    checked = 0

    def mm_checked(self, a, b, c, alpha, beta, flags, out=None):
        from dion3_titan.optim.nonfinite import nonfinite_matrices

        out = self.ops.mm(a, b, out) if c is None else self.ops.mm_add(a, b, c, alpha, beta, out)
        flags[nonfinite_matrices(out)] = 1
        self.checked += 1
        return out


# The (16, 48) group at f = 1 (wide, wide2 and the 3 matrices of stack, one batch) is the only
# one whose Gram side is 16.
WIDE_SIDE, CORRUPTED = 16, 1


def _run_with_backend(monkeypatch, backend, path, steps=3):
    """Dion3 (f = 1, Gram NS in float32) whose every shape group orthogonalizes on ``backend``."""
    import dion3_titan.optim.dion3 as dion3_module

    if backend is not None:
        monkeypatch.setattr(dion3_module, "select_backend", lambda *args: backend)
    opt = _build(Dion3, "raise", fraction=1.0, ns_algorithm="gram")
    _run(opt, steps, path, bad_step=-1)
    monkeypatch.undo()
    return opt


@pytest.mark.parametrize("path", ["eager", "deferred"])
def test_a_nonfinite_ns_result_is_dropped(monkeypatch, path):
    """A matrix whose Newton-Schulz result is not finite gets no update that step (eager or
    captured alike, no host sync): that matrix only decays, every other one moves exactly as
    in a clean run, and the event is counted."""
    clean = _run_with_backend(monkeypatch, None, path, steps=1)
    opt = _run_with_backend(monkeypatch, CorruptOneGram(WIDE_SIDE, CORRUPTED, 1), path, steps=1)
    assert opt.nonfinite_ns_events == 1
    start = {n: p for n, p in zip(NAMES, make_params(7))}
    decay = 1 - 0.02 * 0.1  # lr' wd at f = 1
    moved = []
    for name, p, q in zip(NAMES, opt.param_groups[0]["params"], clean.param_groups[0]["params"]):
        assert torch.isfinite(p).all(), name
        same = [torch.equal(a, b) for a, b in zip(oriented(p.detach()), oriented(q.detach()))]
        decayed = [
            torch.allclose(a, b * decay, rtol=1e-6, atol=0)
            for a, b in zip(oriented(p.detach()), oriented(start[name].detach()))
        ]
        moved += [(name, i) for i, (s, d) in enumerate(zip(same, decayed)) if not s]
        assert all(s or d for s, d in zip(same, decayed)), name
    assert len(moved) == 1, moved  # exactly the corrupted matrix differs from the clean run


class CountGrams:
    """The torch backend, counting Gram products X X^T (Gram NS forms one per start and restart)."""

    def __init__(self) -> None:
        from dion3_titan.kernels.torch_ops import TorchOps

        self.ops, self.grams, self.name = TorchOps(), 0, "count"

    def sym_mm(self, a, b, zero_from=None):
        self.grams += 1
        return self.ops.sym_mm(a, b, zero_from)

    def __getattr__(self, name):
        return getattr(self.ops, name)


@pytest.mark.parametrize("restarts", [(), (2,), (1, 3), (1, 2, 3, 4)], ids=str)
def test_ns_restarts_reach_newton_schulz(monkeypatch, restarts):
    """``ns_restarts`` is what the optimizer's Gram NS restarts at: each shape group forms its
    Gram matrix once plus once per restart, in every step."""
    import dion3_titan.optim.dion3 as dion3_module

    ops = CountGrams()
    monkeypatch.setattr(dion3_module, "select_backend", lambda *args: ops)
    opt = _build(Dion3, "raise", fraction=0.5, ns_algorithm="gram", ns_restarts=restarts)
    _run(opt, 2, "eager", bad_step=-1)
    assert ops.grams == 2 * len(opt._groups) * (1 + len(restarts)), (ops.grams, len(opt._groups))


# ------------------------------------------------------------------------------ a given gradient norm
def _total_norm(opt) -> torch.Tensor:
    """What torchtitan's clipping hands over: the 2-norm of every gradient of the step."""
    return torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]])


def _step_given(opt, path, norm):
    opt.use_gradient_norm(norm)
    (opt.step if path == "eager" else lambda: _deferred_step(opt))()


@pytest.mark.parametrize("path", ["eager", "deferred"])
def test_a_finite_given_norm_steps_as_the_own_pass_does(path):
    """Given the true norm, every step is bit for bit the step the optimizer's own pass takes,
    and each says where its flag came from."""
    given, own = (_build(Dion3, "skip", flavor="normuon", fraction=0.25) for _ in range(2))
    for step in range(4):
        _set_grads(given, step)
        _step_given(given, path, _total_norm(given))
        _set_grads(own, step)
        (own.step if path == "eager" else lambda: _deferred_step(own))()
    _assert_same(_snapshot(own), _snapshot(given))
    assert given.nonfinite.flag_sources == {"gradient_norm": 4, "own_pass": 0}
    assert own.nonfinite.flag_sources == {"gradient_norm": 0, "own_pass": 4}
    assert given.skipped_steps == 0


@pytest.mark.parametrize("path", ["eager", "deferred"])
@pytest.mark.parametrize("bad", ["inf", "nan", "overflow"])
def test_a_nonfinite_given_norm_skips_bit_identical_and_as_if_never_taken(path, bad):
    """The norm decides: finite gradients with an inf/NaN norm (or one beyond float32, which
    counts as non-finite) skip the step, every state bit unchanged and the host counters rolled
    back, and the run goes on as one that never took it."""
    opt = _build(Dion3, "skip", flavor="normuon", fraction=0.25)
    ref = _build(Dion3, "skip", flavor="normuon", fraction=0.25)
    _run(opt, BAD_STEP, path)
    before = _snapshot(opt)
    _set_grads(opt, BAD_STEP)  # finite gradients
    norm = {"inf": torch.tensor(float("inf")), "nan": torch.tensor(float("nan"))}.get(bad)
    _step_given(opt, path, torch.tensor(1e39, dtype=torch.float64) if norm is None else norm)
    assert opt.skipped_steps == 1
    _assert_same(before, _snapshot(opt))
    for step in range(BAD_STEP + 1, BAD_STEP + 3):
        _set_grads(opt, step)
        _step_given(opt, path, _total_norm(opt))
    _run(ref, BAD_STEP + 3, path)
    _assert_same(_snapshot(ref), _snapshot(opt))
    assert opt.nonfinite.flag_sources == {"gradient_norm": 3, "own_pass": BAD_STEP}


def test_a_given_norm_replaces_the_pass_for_one_step_only():
    """With a norm given, the optimizer makes no pass of its own: a NaN planted in a gradient
    while the norm says finite goes through (the pass would have caught it, as it does on the
    next step, which was given no norm)."""
    opt = _build(Dion3, "skip", flavor="muon", fraction=1.0)
    _run(opt, BAD_STEP, "eager")
    _set_grads(opt, BAD_STEP, poison="tall")
    _step_given(opt, "eager", torch.tensor(3.0))
    assert opt.skipped_steps == 0  # not caught: no max-|g| pass ran
    assert not torch.isfinite(opt.state[opt.param_groups[0]["params"][NAMES.index("tall")]]["momentum"]).all()
    assert not opt.nonfinite.norm_given  # consumed by that step
    _set_grads(opt, BAD_STEP + 1, poison="emb")
    opt.step()  # no norm: the own pass
    assert opt.skipped_steps == 1
    assert opt.nonfinite.flag_sources == {"gradient_norm": 1, "own_pass": BAD_STEP + 1}


@pytest.mark.parametrize("path", ["eager", "deferred"])
def test_raise_on_a_nonfinite_given_norm_names_the_step(path):
    opt = _build(Dion3, "raise", flavor="normuon", fraction=0.25)
    _run(opt, BAD_STEP, path)
    before = _snapshot(opt)
    _set_grads(opt, BAD_STEP)
    _step_given(opt, path, torch.tensor(float("nan")))
    _set_grads(opt, BAD_STEP + 1)
    with pytest.raises(FloatingPointError) as info:
        _step_given(opt, path, _total_norm(opt))
    message = str(info.value)
    assert f"gradient norm of step {BAD_STEP + 1} " in message and "is nan" in message, message
    assert "\n" not in message
    _assert_same(before, _snapshot(opt))


def test_use_gradient_norm_takes_one_plain_number():
    opt = _build(Dion3, "skip")
    with pytest.raises(ValueError, match="one number"):
        opt.use_gradient_norm(torch.ones(2))
    assert not opt.nonfinite.norm_given


def test_the_policy_of_the_param_groups_applies():
    """torchtitan 0.3 passes ``nonfinite`` in a group's options, not to the constructor: the
    matrix groups' policy is the optimizer's, and they must agree."""
    params = make_params(7)
    opt = Dion3([{"params": params[:2], "nonfinite": "skip"}, {"params": params[2:], "nonfinite": "skip"}])
    assert opt.nonfinite.policy == "skip"
    with pytest.raises(ValueError, match=r"nonfinite: every matrix param group must use the same value"):
        Dion3([{"params": params[:2], "nonfinite": "skip"}, {"params": params[2:]}])
