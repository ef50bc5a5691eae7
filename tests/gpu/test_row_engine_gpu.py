"""The row engine's kernels on a CUDA GPU: the interpreter checks of
tests/test_row_engine_interpret.py (same inputs, same references, same standards) run on the
device, plus a whole step with the engine on against the torch path at 7B-like shapes."""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    from tests.test_row_engine_interpret import _run_checks

    seed = int.from_bytes(os.urandom(4), "little")
    return [{**r, "seed": seed} for r in _run_checks(seed, "cuda")]


from tests.test_row_engine_interpret import (  # noqa: E402  (the same assertions)
    test_accumulate_adds_bitwise_and_scores_rows,
    test_gather_matches_take_rows_pad_divide_cast_bitwise,
    test_normuon_factors_match_normuon_normalize,
    test_pack_normalizes_by_the_selected_rows_norm,
    test_step_with_engine_matches_reference_path,
    test_update_matches_reference_bitwise,
)

__all__ = [
    "test_accumulate_adds_bitwise_and_scores_rows",
    "test_gather_matches_take_rows_pad_divide_cast_bitwise",
    "test_normuon_factors_match_normuon_normalize",
    "test_pack_normalizes_by_the_selected_rows_norm",
    "test_step_with_engine_matches_reference_path",
    "test_update_matches_reference_bitwise",
]


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_large_step_engine_matches_torch_path(flavor, fraction):
    """4096 x 11008-like shapes (fewer rows), float32 state: the engine's step against the
    torch path's, same NS backend, two steps."""
    from dion3_titan import Dion3
    from dion3_titan.optim import engine

    finals = []
    for fused in (True, False):
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(1024, 4096, device="cuda") * 0.02),
            torch.nn.Parameter(torch.randn(4096, 1376, device="cuda") * 0.02),
            torch.nn.Parameter(torch.randn(4, 512, 1024, device="cuda") * 0.02),
        ]
        start = [p.detach().clone() for p in params]
        opt = Dion3([{"params": params}], lr=0.02, fraction=fraction, flavor=flavor, weight_decay=0.1)
        runs_on = engine.runs_on
        engine.runs_on = lambda backend, p, on=fused: on
        try:
            for _ in range(2):
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
        finally:
            engine.runs_on = runs_on
        finals.append([p.detach() - p0 for p, p0 in zip(params, start)] + [opt.state[p]["momentum"] for p in params])
    for a, b in zip(*finals):  # updates and momentum: rounding of the NS input apart, the same
        assert ((a - b).norm() / b.norm()).item() < 1e-2
