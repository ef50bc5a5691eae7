"""The FSDP equivalence test of tests/test_dist_fsdp.py on two GPUs over NCCL."""

import pytest
import torch

from tests.spawn import spawn
from tests.test_dist_fsdp import CONFIGS, SHAPES, _run

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.timeout(600)]


def _worker(rank, world, configs, backend, out_path):
    results = [_run(world, *c, device=f"cuda:{rank}", backend=backend) for c in configs]
    if rank == 0:
        torch.save(results, out_path)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fsdp_nccl_matches_single_process(tmp_path, backend):
    """The torch stages, and the row engine's (backend "triton"): rows normalized by the
    all-reduced norms into the send buffer, NorMuon's factors back beside the results."""
    out = tmp_path / "r.pt"
    spawn(2, _worker, [(*c, 1, 5) for c in CONFIGS], backend, str(out), backend="nccl")
    for config, r in zip(CONFIGS, torch.load(out)):
        for name, got, want in zip(SHAPES, r["final"], r["ref"]):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (config, name, (got - want).abs().max())
