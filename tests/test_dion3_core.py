"""The Dion3 optimizer on one process: f = 1 equals textbook Muon / NorMuon; f < 1 updates
exactly ceil(f n) rows with error feedback; checkpoints resume bit-exactly; routing."""

import copy
import math
from fractions import Fraction

import pytest
import torch

from dion3_titan import Dion3
from dion3_titan.optim.config import MUON_QUINTIC, Dion3Config
from dion3_titan.optim.routing import build_param_groups, clean_name, is_matrix
from tests import inputs
from tests.reference import TextbookMuon, ns_settings_fp32, textbook_ns

pytestmark = pytest.mark.timeout(120)

# wide, a second wide of the same shape and a 3D stack of that shape (one shape group: offsets),
# tall, square, and a tall 3D stack. Rows are W's rows (dim -2) whatever the shape.
SHAPES = [(16, 48), (16, 48), (40, 12), (24, 24), (3, 16, 48), (2, 32, 8)]
NAMES = ["wide", "wide2", "tall", "square", "stack", "stack_tall"]


def make_params(seed: int, dtype=torch.float32, shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((inputs.randn(s, g) * 0.5).to(dtype)) for s in shapes]


def random_grads(step: int, shapes=SHAPES, seed: int = 100) -> list[torch.Tensor]:
    """This module's gradients of ``step`` (tests/inputs.py draws them)."""
    return inputs.random_grads(seed * 1000 + step, shapes)


def oriented(t: torch.Tensor) -> torch.Tensor:
    """(E, R, C) with R = W's rows (the selection dim)."""
    return t.reshape(-1, *t.shape[-2:])


def k_rows(fraction: float, rows: int) -> int:
    return math.ceil(Fraction(str(fraction)) * rows)


# ------------------------------------------------------------------------------ f = 1 == textbook
@pytest.mark.parametrize("lr_rule", ["spectral", "rms", "none"])
@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_f1_equals_textbook(flavor, lr_rule):
    lr, mu, wd = 0.02, 0.9, 0.1
    params = make_params(0)
    ref_params = [p.detach().clone() for p in params]
    bias = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(9)))
    ref_bias = torch.nn.Parameter(bias.detach().clone())
    opt = Dion3(
        [{"params": params, "names": NAMES}, {"params": [bias], "algorithm": "adamw", "names": ["bias"]}],
        lr=lr,
        fraction=1.0,
        flavor=flavor,
        momentum=mu,
        weight_decay=wd,
        lr_rule=lr_rule,
        ns_dtype="float32",
    )
    ref = TextbookMuon(ref_params, lr=lr, momentum=mu, weight_decay=wd, lr_rule=lr_rule, flavor=flavor)
    ref_adamw = torch.optim.AdamW([ref_bias], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    start = [p.detach().clone() for p in params]
    for t in range(10):
        grads = random_grads(t)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        bias.grad = ref_bias.grad = grads[0][0, :16].clone()
        opt.step()
        ref.step(grads)
        ref_adamw.step()
    for name, p, q, p0, m_ref in zip(NAMES, params, ref_params, start, ref.m):
        assert not torch.equal(p, p0)
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=2e-6, msg=name)
        # the stored momentum is Dion3's decayed buffer mu * (M + G) = mu * (textbook M)
        torch.testing.assert_close(opt.state[p]["momentum"], mu * m_ref, rtol=1e-6, atol=1e-7, msg=name)
        if flavor == "normuon":
            v = opt.state[p]["variance"]
            v = v.to_local() if hasattr(v, "to_local") else v
            torch.testing.assert_close(
                v.reshape(ref.v[NAMES.index(name)].shape).float(),
                ref.v[NAMES.index(name)],
                rtol=1e-5,
                atol=1e-9,
                msg=name,
            )
    torch.testing.assert_close(bias.detach(), ref_bias.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("selection_dim", ["rows", "cols"])
def test_normuon_orientation_matters(selection_dim):
    """NorMuon normalizes along the selection dim: W's rows (output neurons) by default, also for
    a tall matrix, as microsoft/dion does; W's columns with selection_dim="cols". The two give
    measurably different updates (so the textbook test above can fail)."""
    g = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(40, 12, generator=g))
    w0 = w.detach().clone()
    opt = Dion3([w], flavor="normuon", ns_dtype="float32", lr=0.1, selection_dim=selection_dim)
    grad = torch.randn(40, 12, generator=g) * torch.logspace(-1, 1, 12)  # uneven columns
    w.grad = grad.clone()
    opt.step()
    o = textbook_ns(grad, ns_settings_fp32())
    scale = 0.1 * math.sqrt(40 / 12)

    def normuon(oo):  # rows of oo
        v = 0.05 * (oo * oo).mean(dim=1)
        hat = oo / (v.sqrt() + 1e-8)[:, None]
        return hat * (oo.norm() / hat.norm())

    by_rows = w0 - scale * normuon(o)
    by_cols = w0 - scale * normuon(o.T).T
    want, other = (by_rows, by_cols) if selection_dim == "rows" else (by_cols, by_rows)
    torch.testing.assert_close(w.detach(), want, rtol=1e-5, atol=2e-6)
    assert (w.detach() - other).abs().max() > 1e-3


# ------------------------------------------------------------------------------ f < 1
@pytest.mark.parametrize("flavor", ["muon", "normuon"])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.28, 0.5])
def test_fraction_updates_exactly_k_rows(flavor, fraction):
    """k = ceil(f n) exactly (0.28 * 25 is 7, not 8, although 0.28 * 25 > 7 in floats)."""
    lr, mu = 0.02, 0.9
    shapes, names = SHAPES + [(25, 60)], NAMES + ["rows25"]
    params = make_params(1, shapes=shapes)
    opt = Dion3(params, lr=lr, fraction=fraction, flavor=flavor, momentum=mu, weight_decay=0.0, ns_dtype="float32")
    settings = ns_settings_fp32()
    for t in range(4):
        grads = random_grads(t, shapes, seed=7)
        w_old = [p.detach().clone() for p in params]
        m_old = [opt.state[p]["momentum"].clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for name, p, w0, m0, g in zip(names, params, w_old, m_old, grads):
            w_o, w0_o = oriented(p.detach()), oriented(w0)
            pre = oriented(m0 + g)  # M + G, what selection looks at
            m_new = oriented(opt.state[p]["momentum"])
            e, rows, _ = w_o.shape
            k = k_rows(fraction, rows)
            changed = (w_o != w0_o).any(dim=-1)  # (E, R)
            assert changed.sum(dim=1).tolist() == [k] * e, (name, t)
            top = pre.abs().sum(dim=-1).topk(k, dim=1).indices
            expected = torch.zeros_like(changed).scatter_(1, top, True)
            assert torch.equal(changed, expected), (name, t)
            # error feedback: unselected momentum rows are M + G exactly, selected ones decay
            assert torch.equal(m_new[~changed], pre[~changed]), (name, t)
            torch.testing.assert_close(m_new[changed], mu * pre[changed], rtol=1e-6, atol=0)
            if flavor == "muon":  # the selected rows' step: lr * sqrt(d_out/d_in) / sqrt(f) * NS(M[S])
                d_out, d_in = p.shape[-2:]
                scale = lr * math.sqrt(d_out / d_in) / math.sqrt(fraction)
                for b in range(e):
                    idx = changed[b].nonzero().squeeze(1)
                    o = textbook_ns(pre[b, idx], settings)
                    torch.testing.assert_close(w_o[b, idx], w0_o[b, idx] - scale * o, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("transfer", [True, False])
def test_weight_decay_uses_the_transferred_lr(transfer):
    """Alg. 4 decays every row by 1 - lr' wd with lr' the learning rate of the update (lr / sqrt(f)
    with the transfer on): the rows a step does not select change by exactly that factor."""
    lr, wd, fraction = 0.02, 0.1, 0.25
    params = make_params(1, torch.float64)
    opt = Dion3(params, lr=lr, fraction=fraction, weight_decay=wd, fraction_lr_transfer=transfer, ns_dtype="float64")
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, random_grads(3)):
        p.grad = g.double()
    opt.step()
    factor = 1 - lr * wd / (math.sqrt(fraction) if transfer else 1.0)
    for p, w0 in zip(params, before):
        w_o, w0_o = oriented(p.detach()), oriented(w0)
        # rows that only decayed (lr and wd are float32 device scalars: compare to 1e-7)
        kept = ((w_o - w0_o * factor).abs() <= 1e-7 * w0_o.abs()).all(dim=-1)
        k = k_rows(fraction, w_o.shape[1])
        assert kept.sum(dim=1).tolist() == [w_o.shape[1] - k] * w_o.shape[0]


def test_error_feedback_selects_a_persistently_small_row():
    """A row whose gradient is always 20x smaller is never in the top-k by its gradient, but its
    undecayed momentum grows until it is selected (without error feedback it never would be)."""
    g = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(8, 32, generator=g))
    grad = torch.randn(8, 32, generator=g)
    grad[5] *= 0.05
    opt = Dion3([w], fraction=0.25, momentum=0.5, ns_dtype="float32", lr=0.01)
    first = None
    for t in range(200):
        before = w.detach().clone()
        w.grad = grad.clone()
        opt.step()
        if not torch.equal(w[5], before[5]):
            first = t
            break
    assert first is not None and first >= 3


def test_random_selection():
    """selection="random": exactly k rows change each step, not always the l1-largest ones, every
    row gets its turn, and the draws follow the seed."""

    def run(seed):
        g = torch.Generator().manual_seed(6)
        w = torch.nn.Parameter(torch.randn(8, 32, generator=g))
        grad = torch.randn(8, 32, generator=g)
        grad[0] *= 100.0  # l1 selection would pick row 0 every step
        opt = Dion3([w], fraction=0.25, selection="random", seed=seed, ns_dtype="float32")
        picked = []
        for _ in range(24):
            before = w.detach().clone()
            w.grad = grad.clone()
            opt.step()
            changed = (w.detach() != before).any(dim=1)
            assert int(changed.sum()) == 2
            picked.append(changed)
        return w.detach().clone(), torch.stack(picked)

    w_a, picked = run(0)
    assert picked.any(dim=0).all()  # every row selected at some step
    assert not picked[:, 0].all()  # not the l1 choice every time
    w_b, _ = run(0)
    assert torch.equal(w_a, w_b)
    w_c, _ = run(1)
    assert not torch.equal(w_a, w_c)


# ------------------------------------------------------------------------------ checkpoints
def _grads_of(params, step):
    """Gradients that depend on the parameters (so a wrong resume shows) plus seeded noise."""
    g = torch.Generator().manual_seed(500 + step)
    return [(0.1 * p.detach().float() + torch.randn(p.shape, generator=g)).to(p.dtype) for p in params]


CHECKPOINT_CASES = [
    ("muon", 1.0, torch.float32, "l1"),
    ("muon", 0.25, torch.float32, "l1"),
    ("normuon", 1.0, torch.float32, "l1"),
    ("normuon", 0.25, torch.float32, "l1"),
    ("normuon", 0.25, torch.bfloat16, "l1"),
    ("muon", 0.25, torch.float32, "random"),
]


@pytest.mark.parametrize(
    "flavor,fraction,dtype,selection",
    [pytest.param(*c) for c in CHECKPOINT_CASES],
    ids=["-".join(map(str, c)).replace("torch.", "") for c in CHECKPOINT_CASES],
)
def test_state_dict_resume_is_bit_exact(flavor, fraction, dtype, selection):
    def build(data):
        mats = [torch.nn.Parameter(d.clone()) for d in data[:-1]]
        bias = torch.nn.Parameter(data[-1].clone())
        opt = Dion3(
            [{"params": mats, "names": NAMES}, {"params": [bias], "algorithm": "adamw"}],
            lr=0.02,
            fraction=fraction,
            flavor=flavor,
            selection=selection,
            weight_decay=0.01,
        )
        return mats + [bias], opt

    def run(params, opt, steps):
        for t in steps:
            for p, g in zip(params, _grads_of(params, t)):
                p.grad = g
            opt.step()

    init = [p.detach() for p in make_params(2, dtype)] + [torch.randn(16).to(dtype)]
    params, opt = build(init)
    run(params, opt, range(3))
    saved_state = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in params]
    run(params, opt, range(3, 6))

    params2, opt2 = build(saved_params)
    opt2.load_state_dict(saved_state)
    for p in params2[:-1]:
        st = opt2.state[p]
        assert st["momentum"].dtype == p.dtype
        if flavor == "normuon":
            assert st["variance"].dtype == torch.float32  # not cast to the parameter's dtype
    run(params2, opt2, range(3, 6))
    for name, a, b, s in zip(NAMES + ["bias"], params, params2, saved_params):
        assert not torch.equal(a, s), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_zero_grad_step_with_lr0_changes_nothing(flavor, dtype):
    """The step that creates checkpoint state (zero grads, lr = 0) leaves the parameters bitwise
    unchanged and the state finite, even with weight decay."""
    params = make_params(3, dtype)
    before = [p.detach().clone() for p in params]
    opt = Dion3(params, lr=0.0, flavor=flavor, weight_decay=0.1, fraction=0.5)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        for v in opt.state[p].values():
            assert torch.isfinite(v).all()
    # and it is not inert: a real step afterwards moves every matrix
    for g in opt.param_groups:
        g["lr"] = 0.02
    for p, gr in zip(params, random_grads(0)):
        p.grad = gr.to(dtype)
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


# ------------------------------------------------------------------------------ non-finite gradients
def test_nonfinite_gradient_raise_names_the_parameter():
    params = make_params(4)
    before = [p.detach().clone() for p in params]
    opt = Dion3([{"params": params, "names": NAMES}], nonfinite="raise")
    grads = random_grads(0)
    grads[2][3, 1] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()  # the host learns of the bad gradient without waiting: at the next step
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    for p, g in zip(params, random_grads(1)):
        p.grad = g
    with pytest.raises(FloatingPointError, match="tall"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)


def test_nonfinite_gradient_skip_leaves_everything_unchanged():
    params = make_params(4)
    before = [p.detach().clone() for p in params]
    opt = Dion3([{"params": params, "names": NAMES}], nonfinite="skip", flavor="normuon")
    grads = random_grads(0)
    grads[4][1, 2, 3] = float("inf")
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        assert torch.equal(opt.state[p]["momentum"], torch.zeros_like(p))
    # the next finite step proceeds normally
    for p, g in zip(params, random_grads(1)):
        p.grad = g
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


# ------------------------------------------------------------------------------ routing
def _llama_like_named_params():
    dim, hidden, vocab, experts = 16, 48, 40, 3
    t = {
        "tok_embeddings.weight": (vocab, dim),
        "layers.0.attention.wq.weight": (dim, dim),
        "layers.0.attention.wk.weight": (8, dim),
        "layers.0.attention.wo.weight": (dim, dim),
        "layers.0.attention_norm.weight": (dim,),
        "layers.0.ffn_norm.weight": (dim,),
        "layers.0.feed_forward.w1.weight": (hidden, dim),
        "layers.0.feed_forward.w2.weight": (dim, hidden),
        "layers.0.moe.experts.w1": (experts, hidden, dim),
        "layers.0.moe.router.gate.weight": (experts, dim),
        "layers.0.attention.wq.bias": (dim,),
        "norm.weight": (dim,),
        "output.weight": (vocab, dim),
    }
    return {name: torch.nn.Parameter(torch.randn(*shape)) for name, shape in t.items()}


DION3_NAMES = {
    "layers.0.attention.wq.weight",
    "layers.0.attention.wk.weight",
    "layers.0.attention.wo.weight",
    "layers.0.feed_forward.w1.weight",
    "layers.0.feed_forward.w2.weight",
    "layers.0.moe.experts.w1",
}


def _wrap(name: str, how: str) -> str:
    if how == "plain":
        return name
    if how == "compile":
        return "_orig_mod." + name
    if how == "checkpoint" and name.startswith("layers.0."):  # torchtitan wraps each block
        return "layers.0._checkpoint_wrapped_module." + name[len("layers.0.") :]
    if how == "both" and name.startswith("layers.0."):
        return "_orig_mod.layers.0._checkpoint_wrapped_module." + name[len("layers.0.") :]
    return ("_orig_mod." + name) if how == "both" else name


@pytest.mark.parametrize("how", ["plain", "compile", "checkpoint", "both"])
def test_build_param_groups_routes_llama_names(how):
    params = _llama_like_named_params()
    named = [(_wrap(n, how), p) for n, p in params.items()]
    groups = build_param_groups(named)
    assert [g["algorithm"] for g in groups] == ["dion3", "adamw"]
    dion3, adamw = groups
    assert set(dion3["names"]) == DION3_NAMES
    assert set(adamw["names"]) == set(params) - DION3_NAMES
    assert [id(p) for p in dion3["params"]] == [id(params[n]) for n in dion3["names"]]
    assert [id(p) for p in adamw["params"]] == [id(params[n]) for n in adamw["names"]]
    # the groups build an optimizer that steps
    opt = Dion3(groups, lr=0.01)
    for p in params.values():
        p.grad = torch.randn_like(p)
    before = {n: p.detach().clone() for n, p in params.items()}
    opt.step()
    assert all(not torch.equal(params[n], before[n]) for n in params)


def test_routing_helpers():
    assert (
        clean_name("_orig_mod.layers.3._checkpoint_wrapped_module.attention.wq.weight")
        == "layers.3.attention.wq.weight"
    )
    assert is_matrix("layers.0.moe.experts.w3", torch.empty(2, 4, 4))
    assert not is_matrix("layers.0.attention.wq.weight", torch.empty(4))  # 1D
    assert not is_matrix("layers.0.x", torch.empty(2, 2, 2, 2))  # 4D
    assert not is_matrix("_orig_mod.output.weight", torch.empty(4, 4))
    frozen = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    groups = build_param_groups([("layers.0.feed_forward.w1.weight", frozen)], adamw_lr=1e-3)
    assert groups[0]["params"] == [] and groups[1]["params"] == [] and groups[1]["lr"] == 1e-3


def test_resume_keeps_every_split_piece_variance_float32():
    """A parameter split into pieces (split_heads) keeps its pieces' NorMuon second moments in
    one state over its rows; after load_state_dict it is still float32 (not the bf16 parameter
    dtype) and the resumed run is bit-exact."""
    names = ["layers.0.attention.wq.weight", "layers.0.feed_forward.w1.weight"]
    shapes = [(16, 48), (48, 16)]

    def build(data):
        ps = [torch.nn.Parameter(d.clone()) for d in data]
        opt = Dion3([{"params": ps, "names": names}], flavor="normuon", split_heads=2, fraction=0.5)
        return ps, opt

    def run(ps, opt, steps):
        for t in steps:
            for p, g in zip(ps, _grads_of(ps, t)):
                p.grad = g
            opt.step()

    ps, opt = build([p.detach() for p in make_params(8, torch.bfloat16, shapes)])
    keys = [k for k in opt.state[ps[0]] if k.startswith("variance")]
    assert keys == ["variance"] and opt.state[ps[0]]["variance"].shape == (16,)  # both head blocks' rows
    run(ps, opt, range(2))
    saved, saved_params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in ps]
    run(ps, opt, range(2, 4))
    ps2, opt2 = build(saved_params)
    opt2.load_state_dict(saved)
    for p in ps2:
        for k, v in opt2.state[p].items():
            if k.startswith("variance"):
                assert v.dtype == torch.float32, k
    run(ps2, opt2, range(2, 4))
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_single_rank_fast_packing_equals_the_general_path(flavor, monkeypatch):
    """At f = 1 on one rank the step normalizes each momentum view straight into the NS batch;
    the general path (float32 concatenation, then normalization) must give the same bits. Wide
    and tall shape groups (the tall one in a selection_dim="cols" group, so that it selects the
    weight's columns: a transposed batch) of two matrices each."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(24, 40), (24, 40), (56, 16), (56, 16)]
    params = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(3)]

    def run(force_general: bool) -> list[torch.Tensor]:
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        groups = [{"params": ps[:2]}, {"params": ps[2:], "selection_dim": "cols"}]
        opt = Dion3(groups, lr=0.02, fraction=1.0, flavor=flavor, ns_dtype="float32", backend="torch")
        if force_general:
            for sg in opt._groups:
                sg.exchange.moves_data = True  # as if the batch had to travel: pack it first
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in ps]

    from dion3_titan.optim import stages_reference as dion3_module  # the reference pack

    calls = []
    real = dion3_module.normalize_batch
    monkeypatch.setattr(dion3_module, "normalize_batch", lambda views, *a: calls.append(views) or real(views, *a))
    fast = run(False)
    transposed = [dion3_module.is_transposed_batch(views) for views in calls]
    assert len(calls) == 2 * len(grads) and set(transposed) == {False, True}  # both layouts took it
    calls.clear()
    general = run(True)
    assert not calls
    assert all(torch.equal(a, b) for a, b in zip(fast, general))
    assert not all(torch.equal(a, p) for a, p in zip(fast, params))  # it did update


# ------------------------------------------------------------------------------ torch.optim.Muon
# torch's adjust_lr_fn and our lr_rule that give every shape the same multiplier: "original" is
# sqrt(max(1, d_out/d_in)), which "spectral" equals for tall and square matrices only.
TORCH_LR_RULES = {
    "match_rms_adamw": ("rms", [(16, 48), (40, 12), (24, 24)]),
    "original": ("spectral", [(40, 12), (24, 24)]),
}


def _displacement_vs_torch_muon(adjust_lr_fn: str, coefficients) -> float:
    """Relative difference of W_10 - W_0 between Dion3 (f = 1, Muon flavor, standard NS in
    bf16) and torch.optim.Muon (nesterov off, weight decay on) fed the same gradients."""
    lr_rule, shapes = TORCH_LR_RULES[adjust_lr_fn]
    start = make_params(3, shapes=shapes)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in start]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in start]
    opt = Dion3(
        ours,
        lr=0.02,
        fraction=1.0,
        flavor="muon",
        momentum=0.95,
        weight_decay=0.1,
        lr_rule=lr_rule,
        ns_algorithm="standard",
        ns_coefficients=coefficients,
        ns_dtype="bfloat16",
        backend="torch",
    )
    ref = torch.optim.Muon(theirs, lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=False, adjust_lr_fn=adjust_lr_fn)
    for t in range(10):
        for a, b, g in zip(ours, theirs, random_grads(t, shapes, seed=5)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    d_ours = torch.cat([(a - p).detach().flatten() for a, p in zip(ours, start)])
    d_torch = torch.cat([(b - p).detach().flatten() for b, p in zip(theirs, start)])
    return float((d_ours - d_torch).norm() / d_torch.norm())


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("adjust_lr_fn", sorted(TORCH_LR_RULES))
def test_f1_muon_coefficients_follow_torch_muon(adjust_lr_fn):
    """ns_coefficients="muon" is Muon's quintic whatever ns_safety_factor says: 10 steps stay
    within 2% of torch.optim.Muon's displacement (bf16 NS rounds differently in the two). The
    same quintic divided by 1.05 (what a safety factor would do) leaves that band."""
    assert Dion3Config(ns_coefficients="muon", ns_safety_factor=1.2).coefficients() == (MUON_QUINTIC,) * 5
    assert _displacement_vs_torch_muon(adjust_lr_fn, "muon") < 0.02
    scaled = [(a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in (MUON_QUINTIC,) * 5]
    assert _displacement_vs_torch_muon(adjust_lr_fn, scaled) > 0.05


def test_float64_matrices_at_fraction_below_one() -> None:
    """float64 parameters select rows too (the l1 score once refused to narrow float64)."""
    g = torch.Generator().manual_seed(21)
    w = torch.nn.Parameter(torch.randn(12, 20, generator=g, dtype=torch.float64))
    before = w.detach().clone()
    opt = Dion3([w], lr=0.02, fraction=0.25, ns_dtype="float64", weight_decay=0.0)
    w.grad = torch.randn(12, 20, generator=g, dtype=torch.float64)
    opt.step()
    moved = (w.detach() != before).any(dim=1)
    assert int(moved.sum()) == 3  # ceil(0.25 * 12) rows, the others untouched


def test_a_checkpoint_restores_the_live_settings_and_keeps_the_built_ones():
    """load_state_dict takes lr, weight decay and momentum from the checkpoint (torch's
    convention) and keeps every other setting the optimizer was built with (its plan is made
    from them): a checkpoint saved at f = 1/2 loaded into an optimizer built at f = 1/4 steps
    at f = 1/4 with f = 1/4's lr transfer, named in one warning; the same settings warn of
    nothing, and the steps after the load match a run that was never saved."""
    import warnings

    torch.manual_seed(11)
    w0 = torch.randn(32, 64)

    def build(**kw):
        p = torch.nn.Parameter(w0.clone())
        return p, Dion3([{"params": [p]}], backend="torch", weight_decay=0.1, **kw)

    def steps(p, opt, seeds):
        for s in seeds:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s))
            opt.step()

    p, opt = build(lr=0.02, fraction=0.5, momentum=0.9)
    steps(p, opt, [0, 1])
    saved, w_saved = copy.deepcopy(opt.state_dict()), p.detach().clone()

    q, other = build(lr=0.05, fraction=0.25, ns_steps=4, momentum=0.8)
    with pytest.warns(UserWarning, match=r"fraction=0\.5 \(kept 0\.25\).*ns_steps=5 \(kept 4\)"):
        other.load_state_dict(saved)
    group = other.param_groups[0]
    assert (group["lr"], group["momentum"]) == (0.02, 0.9)  # live: the checkpoint's
    assert (group["fraction"], group["ns_steps"]) == (0.25, 4)  # built: this optimizer's
    assert other.configs[0].fraction == 0.25 and other.shape_groups[0].k == 8
    # the loaded optimizer steps as one built with those settings and the saved state
    with torch.no_grad():
        q.copy_(w_saved)
    r, same = build(lr=0.02, fraction=0.25, ns_steps=4, momentum=0.9)
    with torch.no_grad():
        r.copy_(w_saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same settings: nothing to name
        same.load_state_dict(copy.deepcopy(other.state_dict()))
    steps(q, other, [2, 3])
    steps(r, same, [2, 3])
    assert torch.equal(q, r)
    assert not torch.equal(q, w_saved)
