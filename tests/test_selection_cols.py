"""``selection_dim = "cols"``: each step updates exactly the ceil(f * d_in) columns of W whose
momentum has the largest l1 norm, by the Newton-Schulz polynomial of those columns (checked
against a float64 reference through the SVD), and no other column; unselected momentum columns
keep M + G, selected ones decay by mu (error feedback)."""

import math

import pytest
import torch

from dion3_titan import Dion3
from dion3_titan.optim.config import Dion3Config
from tests.reference import ns_polynomial_via_svd

pytestmark = pytest.mark.timeout(120)

SEED = 3
SHAPES = [(16, 48), (40, 12), (24, 24), (3, 16, 48)]  # wide, tall, square, a stack
LR, MU, FRACTION, BETA2, EPS = 0.02, 0.9, 0.25, 0.95, 1e-8


def _normuon(o: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon on rows of o (k, n): the selected columns of W, one row each."""
    v = BETA2 * v + (1 - BETA2) * o.square().mean(dim=1)
    hat = o / (v.sqrt() + EPS)[:, None]
    return hat * (o.norm() / hat.norm()), v


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_cols_selection_matches_float64_reference(flavor):
    g = torch.Generator().manual_seed(SEED)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = Dion3(
        params,
        lr=LR,
        fraction=FRACTION,
        flavor=flavor,
        momentum=MU,
        ns_dtype="float32",
        backend="torch",
        selection_dim="cols",
    )
    coefficients = Dion3Config().coefficients()
    # float64 reference of each step from the optimizer's state before it (weights, momentum
    # and NorMuon's per-column moment), so that float32 rounding does not accumulate
    vs = [torch.zeros(math.prod(s[:-2]), s[-1], dtype=torch.float64) for s in SHAPES]
    for step in range(3):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        before = [p.detach().clone() for p in params]
        pre = [opt.state[p]["momentum"] + gr for p, gr in zip(params, grads)]  # M + G, float32
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for i, p in enumerate(params):
            n, m = p.shape[-2:]
            k = math.ceil(FRACTION * m)
            scale = LR * math.sqrt(n / m) / math.sqrt(FRACTION)
            got = p.detach().reshape(-1, n, m)
            old = before[i].reshape(-1, n, m)
            mom = opt.state[p]["momentum"].reshape(-1, n, m)
            acc = pre[i].reshape(-1, n, m)
            for b in range(got.shape[0]):
                cols = acc[b].double().abs().sum(dim=0).topk(k).indices.sort().values
                changed = (got[b] != old[b]).any(dim=0).nonzero().squeeze(1)
                assert torch.equal(changed, cols), (SEED, step, i, b)  # these columns and no other
                o = ns_polynomial_via_svd(acc[b][:, cols].double()[None], coefficients)[0]  # (n, k)
                if flavor == "normuon":
                    hat, vs[i][b, cols] = _normuon(o.T, vs[i][b, cols])
                    o = hat.T
                want = old[b].double()
                want[:, cols] -= scale * o
                torch.testing.assert_close(
                    got[b].double(), want, rtol=1e-4, atol=1e-5, msg=lambda s: f"seed {SEED} step {step} param {i}: {s}"
                )
                rest = torch.ones(m, dtype=torch.bool)
                rest[cols] = False
                assert torch.equal(mom[b][:, rest], acc[b][:, rest])  # unselected: M + G exactly
                torch.testing.assert_close(mom[b][:, cols], MU * acc[b][:, cols], rtol=1e-6, atol=0)
