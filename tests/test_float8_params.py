"""Parameters that are tensor subclasses wrapping the real weight (torchao's float8 training
weights, as torchtitan's float8 converter makes them) train exactly like plain parameters,
through torch ops and through the Triton fused update (which needs the real storage; run on
CPU by Triton's interpreter in a child process, since Triton reads TRITON_INTERPRET at import)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dion3_titan import Dion3

float8 = pytest.importorskip("torchao.float8.fsdp_utils")
from torchao.float8.float8_linear import LinearMMConfig  # noqa: E402


def _params(wrap: bool) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 32), (96, 32), (32, 96)]
    out = []
    for shape in shapes:
        w = torch.randn(shape, generator=gen)
        if wrap:
            w = float8.WeightWithDynamicFloat8CastTensor(w, LinearMMConfig(), torch.float8_e4m3fn)
        out.append(torch.nn.Parameter(w))
    return out


def compare(flavor: str, backend: str) -> None:
    runs = []
    for wrap in (False, True):
        params = _params(wrap)
        names = [f"layers.0.w{i}.weight" for i in range(len(params))]
        opt = Dion3(
            [{"params": params, "names": names}],
            lr=0.02,
            fraction=0.5,
            flavor=flavor,
            ns_dtype="float32",
            weight_decay=0.1,
            backend=backend,
        )
        gen = torch.Generator().manual_seed(11)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        if wrap:
            assert all(type(p.data) is float8.WeightWithDynamicFloat8CastTensor for p in params)
            assert all(type(opt.state[p]["momentum"]) is torch.Tensor for p in params)
        runs.append([(p._tensor if wrap else p).detach().clone() for p in params])
    for plain, wrapped in zip(*runs):
        assert torch.equal(plain, wrapped)
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], _params(False)))  # it did train


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_float8_wrapped_weights_update_like_plain_ones(flavor: str) -> None:
    compare(flavor, "torch")


def test_float8_wrapped_weights_through_the_triton_update() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "tests.test_float8_params"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ok triton" in run.stdout


if __name__ == "__main__":
    from tests.interpret import patch_language_once

    patch_language_once()
    compare("normuon", "triton")
    print("ok triton")
