"""Dion3Optimizers.Config on torchtitan 0.3: our names' optimizer_kwargs are validated while the
config is built, with the TOML keys' messages; a bad kwarg stops a real launch before step 1."""

from pathlib import Path

import pytest
from torchtitan.components.optimizer import ParamGroupConfig

from dion3_titan.titan03.optimizers import Dion3Optimizers
from tests.titan03.helpers import ensure_corpus, logged_losses, run_titan03


def _config(name: str, **kwargs) -> Dion3Optimizers.Config:
    return Dion3Optimizers.Config(
        param_groups=[
            ParamGroupConfig(pattern=r"\.weight$", optimizer_name=name, optimizer_kwargs=kwargs),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        ]
    )


@pytest.mark.parametrize(
    "name, kwargs, words",
    [
        ("Dion3", {"fraction": 1.5}, ["optimizer_kwargs", "fraction=1.5", "(0, 1]"]),
        ("Dion3", {"flavor": "x"}, ["flavor='x'", "('muon', 'normuon')"]),
        ("Dion3", {"ns_dtype": "int8"}, ["ns_dtype='int8'", "float16"]),
        ("Dion3", {"fractoin": 0.5}, ["unknown key(s) ['fractoin']", "'fraction'"]),
        ("Muon", {"fraction": 0.25}, ["fraction=0.25", "optimizer_name='Muon'", "optimizer_name='Dion3'"]),
        ("NorMuon", {"flavor": "muon"}, ["flavor='muon'", "'NorMuon'"]),
        ("Dion3", {"refresh_period": 2}, ["refresh_period", "optimizer_name='PRMuon'"]),
        ("PRMuon", {"refresh_period": 0}, ["refresh_period=0", ">= 1"]),
    ],
)
def test_bad_kwargs_name_the_key_and_allowed_values(name, kwargs, words) -> None:
    with pytest.raises(ValueError) as err:
        _config(name, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "param_groups[0]" in str(err.value)


@pytest.mark.parametrize(
    "name, fixed", [("Muon", (1.0, "muon")), ("NorMuon", (1.0, "normuon")), ("PRMuon", (1.0, "muon"))]
)
def test_names_accept_agreeing_and_default_kwargs(name, fixed) -> None:
    _config(name, lr=0.02, fraction=fixed[0], flavor=fixed[1])
    _config(name)


def test_cuda_graph_with_prmuon_is_refused() -> None:
    with pytest.raises(ValueError, match="cuda_graph=True is not supported with optimizer_name='PRMuon'"):
        Dion3Optimizers.Config(
            cuda_graph=True, param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="PRMuon", optimizer_kwargs={})]
        )


@pytest.mark.parametrize("warmup", [0, -2, True, 1.5])
def test_cuda_graph_warmup_below_one_or_not_an_integer_is_refused(warmup) -> None:
    with pytest.raises(ValueError, match=rf"cuda_graph_warmup={warmup!r}: must be an integer >= 1"):
        Dion3Optimizers.Config(
            cuda_graph_warmup=warmup,
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="Dion3", optimizer_kwargs={})],
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "config, words",
    [("bad_fraction", ["fraction=1.5", "(0, 1]"]), ("misspelled_key", ["fractoin", "allowed keys"])],
)
def test_bad_kwarg_stops_a_launch_before_step_1(tmp_path: Path, config: str, words: list[str]) -> None:
    ensure_corpus()
    run = run_titan03(config, tmp_path, nproc=1)
    assert run.returncode != 0
    assert not logged_losses(run.output), "training started"
    assert not run.records, "a trainer was built"
    assert all(w in run.output for w in words), run.output[-4000:]
