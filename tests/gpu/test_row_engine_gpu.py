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
    test_error_feedback_of_every_row_runs_in_the_accumulate,
    test_gather_matches_take_rows_pad_divide_cast_bitwise,
    test_grouped_launches_match_the_torch_path_bitwise,
    test_normuon_factors_match_normuon_normalize,
    test_pack_normalizes_by_the_selected_rows_norm,
    test_step_launches_do_not_grow_with_layers,
    test_step_with_engine_matches_reference_path,
    test_update_matches_reference_bitwise,
)

__all__ = [
    "test_accumulate_adds_bitwise_and_scores_rows",
    "test_error_feedback_of_every_row_runs_in_the_accumulate",
    "test_gather_matches_take_rows_pad_divide_cast_bitwise",
    "test_grouped_launches_match_the_torch_path_bitwise",
    "test_normuon_factors_match_normuon_normalize",
    "test_pack_normalizes_by_the_selected_rows_norm",
    "test_step_launches_do_not_grow_with_layers",
    "test_step_with_engine_matches_reference_path",
    "test_update_matches_reference_bitwise",
]


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_large_step_engine_matches_torch_path(flavor, fraction, weight_decay):
    """4096 x 11008-like shapes (fewer rows), float32 state: the engine's step against the
    torch path's, same NS backend, two steps (without weight decay the update launch walks
    the selected rows only)."""
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
        opt = Dion3([{"params": params}], lr=0.02, fraction=fraction, flavor=flavor, weight_decay=weight_decay)
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


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_captured_step_reuses_the_eager_steps_tables(flavor):
    """The row engine's tables are built by the eager warm-up step: capture and replays build
    none and give the eager run's bits; a state reload (new momentum and NorMuon state
    tensors) re-captures after one eager step, which builds the new tables."""
    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    shapes = [(256, 512), (512, 256), (2, 128, 256)] * 3
    finals, builds = [], []
    for graphed in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        opt = Dion3([{"params": params}], lr=0.02, fraction=0.25, flavor=flavor, weight_decay=0.1)
        runner = GraphedOptimizer(opt, warmup_steps=1) if graphed else opt
        for p in params:
            p.grad = torch.zeros_like(p)
        for step in range(8):
            g = torch.Generator(device="cuda").manual_seed(step)
            for p in params:
                p.grad.copy_(torch.randn(p.shape, device="cuda", generator=g))
            if step == 5:  # new state tensors: tables for them, built eagerly before a capture
                runner.load_state_dict(runner.state_dict())
            runner.step()
            builds.append(opt.kernel_tables.builds)
        torch.cuda.synchronize()
        if graphed:
            assert runner.graph is not None
            assert builds[-8] == builds[-4], builds  # step 0 eager; 1 captured and 2-4 replayed
            assert builds[-3] == builds[-1], builds  # 5 eager after the reload; 6 captured, 7 replayed
            runner.release()
        finals.append([p.detach().clone() for p in params])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_table_built_behind_queued_work_is_readable_on_another_stream(seed) -> None:
    """A kernel table is on the device when ``operand`` returns, even when the stream that built
    it has work queued: with ``ns_overlap`` a table built on one stream is read on the other
    (a copy queued behind that work would be read as whatever the memory held)."""
    from dion3_titan.kernels.row_engine import TableCache, operand

    g = torch.Generator().manual_seed(seed)
    base = torch.empty(1 << 16, device="cuda")
    starts = sorted(torch.randperm(1 << 10, generator=g)[:3].tolist())
    views = [base[64 * s : 64 * s + 2 * 3 * 8].view(2, 3, 8) for s in starts]
    expected = [[64 * (s - starts[0]) + 24 * i, 8, 1, 1] for s in starts for i in range(2)]
    busy, reader = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of work queued ahead of anything it is given
        table = operand(views, cache=TableCache()).table
    with torch.cuda.stream(reader):
        seen = table.clone()
    torch.cuda.synchronize()
    assert seen.tolist() == expected, f"seed {seed}"
