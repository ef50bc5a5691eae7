"""Every invalid option fails at construction with a ValueError naming the key and what is
allowed; valid values pass through unchanged."""

import math
import re

import pytest
import torch

from dion3_titan import Dion3, Dion3Config
from dion3_titan.optim.config import (
    BACKENDS,
    COEFFICIENT_SETS,
    FLAVORS,
    LR_RULES,
    NONFINITE,
    NS_ALGORITHMS,
    NS_DTYPES,
    SELECTION_DIMS,
    SELECTION_SCOPES,
    SELECTIONS,
    lr_scale,
)

pytestmark = pytest.mark.timeout(60)

CHOICES = [
    ("flavor", "adam", FLAVORS),
    ("lr_rule", "mup", LR_RULES),
    ("ns_algorithm", "qr", NS_ALGORITHMS),
    ("ns_coefficients", "chebyshev", COEFFICIENT_SETS),
    ("ns_dtype", "float8", tuple(NS_DTYPES)),
    ("selection", "l2", SELECTIONS),
    ("selection_scope", "world", SELECTION_SCOPES),
    ("selection_dim", "auto", SELECTION_DIMS),  # the side must never follow the sharding
    ("backend", "cuda", BACKENDS),
    ("nonfinite", "ignore", NONFINITE),
]


def _param(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


def _check_message(err: pytest.ExceptionInfo, key: str, bad, allowed) -> None:
    msg = str(err.value)
    assert key in msg, msg
    assert repr(bad) in msg, msg
    for a in allowed:
        assert repr(a) in msg or str(a) in msg, (a, msg)


@pytest.mark.parametrize("key,bad,allowed", CHOICES, ids=[c[0] for c in CHOICES])
def test_bad_choice_names_key_and_allowed_values(key, bad, allowed):
    assert len(allowed) >= 2
    with pytest.raises(ValueError) as err:
        Dion3Config(**{key: bad})
    _check_message(err, key, bad, allowed)
    # the optimizer constructor and a param group override fail the same way
    with pytest.raises(ValueError) as err:
        Dion3([_param(4, 8)], **{key: bad})
    _check_message(err, key, bad, allowed)
    with pytest.raises(ValueError) as err:
        Dion3([{"params": [_param(4, 8)], key: bad}])
    _check_message(err, key, bad, allowed)


@pytest.mark.parametrize("key,good", [(k, a) for k, _, allowed in CHOICES for a in allowed])
def test_every_allowed_choice_is_accepted(key, good):
    assert getattr(Dion3Config(**{key: good}), key) == good


@pytest.mark.parametrize("fraction", [0.0, -0.25, 1.0001, 2, float("nan"), "0.5"])
def test_bad_fraction(fraction):
    with pytest.raises(ValueError, match=r"fraction=.*\(0, 1\]"):
        Dion3Config(fraction=fraction)
    with pytest.raises(ValueError, match="fraction"):
        Dion3([_param(4, 8)], fraction=fraction)


@pytest.mark.parametrize("fraction", [1e-6, 0.125, 1.0, 1])
def test_good_fraction(fraction):
    assert Dion3Config(fraction=fraction).fraction == fraction


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"ns_restarts": (0,)}, "ns_restarts"),
        ({"ns_restarts": (5,)}, "ns_restarts"),
        ({"ns_restarts": (2, 7), "ns_steps": 6}, "ns_restarts"),
        ({"ns_restarts": (-1,)}, "ns_restarts"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"ns_steps": 2.5}, "ns_steps"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"normuon_beta2": 1.0}, "normuon_beta2"),
        ({"weight_decay": -1e-3}, "weight_decay"),
        ({"lr": -1.0}, "lr"),
        ({"ns_safety_factor": 0.9}, "ns_safety_factor"),
        ({"ns_coefficients": [(1.0, 2.0)] * 3, "ns_steps": 3}, "ns_coefficients"),
        ({"ns_coefficients": [], "ns_steps": 3}, "ns_coefficients"),
        ({"ns_coefficients": [(3.0, -4.0, 2.0)] * 3, "ns_steps": 5}, "ns_coefficients"),
    ],
)
def test_bad_ranges(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        Dion3Config(**kwargs)


def test_ns_restarts_message_gives_the_range():
    with pytest.raises(ValueError) as err:
        Dion3Config(ns_restarts=(5,), ns_steps=5)
    assert "ns_restarts" in str(err.value) and "1..4" in str(err.value)
    assert Dion3Config(ns_restarts=(1, 4), ns_steps=5).ns_restarts == (1, 4)
    assert Dion3Config(ns_restarts=[], ns_steps=5).ns_restarts == ()


def test_explicit_coefficients():
    cfg = Dion3Config(ns_coefficients=[(3.0, -3.2, 1.2)] * 4, ns_steps=4)
    assert cfg.coefficients() == ((3.0, -3.2, 1.2),) * 4
    pe = Dion3Config(ns_steps=10).coefficients()  # later steps repeat the converged polynomial
    assert len(pe) == 10 and pe[9] == pe[8] == pe[7] and pe[0] != pe[1]


def test_unknown_keyword_to_dion3():
    with pytest.raises(ValueError) as err:
        Dion3([_param(4, 8)], lr=0.01, fractoin=0.5)
    msg = str(err.value)
    assert "fractoin" in msg and "fraction" in msg and "flavor" in msg


def test_1d_param_in_dion3_group():
    with pytest.raises(ValueError) as err:
        Dion3([{"params": [_param(4, 8), _param(8)], "names": ["w", "b"]}])
    msg = str(err.value)
    assert "1D" in msg and "(8,)" in msg and "adamw" in msg
    with pytest.raises(ValueError, match="4D"):
        Dion3([_param(2, 2, 2, 2)])
    Dion3([{"params": [_param(4, 8)]}, {"params": [_param(8)], "algorithm": "adamw"}])  # fine


@pytest.mark.parametrize(
    "group, line",
    [
        ({"lr": -1.0}, "lr=-1.0: must be a number >= 0"),
        ({"betas": (0.9, 1.0)}, "betas[1]=1.0: must be a number in [0, 1)"),
        ({"betas": (0.9,)}, "betas=(0.9,): must be two numbers (beta1, beta2)"),
        ({"eps": "small"}, "eps='small': must be a number >= 0"),
        ({"weight_decay": -0.5}, "weight_decay=-0.5: must be a number >= 0"),
    ],
)
def test_bad_adamw_group_names_the_key(group, line):
    """The AdamW group's hyperparameters are checked as torch.optim.AdamW checks them (the step
    calls the functional adamw, which would take a negative lr or a beta of 1 silently)."""
    with pytest.raises(ValueError) as err:
        Dion3([{"params": [_param(4, 8)]}, {"params": [_param(8)], "algorithm": "adamw", **group}])
    assert str(err.value) == f"param group 1 (algorithm 'adamw'): {line}"


def test_bad_algorithm_in_group():
    with pytest.raises(ValueError) as err:
        Dion3([{"params": [_param(4, 8)]}, {"params": [_param(8)], "algorithm": "sgd"}])
    msg = str(err.value)
    assert "algorithm" in msg and "'sgd'" in msg and "'dion3'" in msg and "'adamw'" in msg


def test_lr_scale_rules():
    assert lr_scale(64, 16, "spectral", 1.0, True) == pytest.approx(2.0)
    assert lr_scale(16, 64, "spectral", 0.25, True) == pytest.approx(0.5 / 0.5)
    assert lr_scale(16, 64, "spectral", 0.25, False) == pytest.approx(0.5)
    assert lr_scale(16, 64, "rms", 1.0, True) == pytest.approx(0.2 * 8)
    assert lr_scale(16, 64, "none", 0.25, True) == pytest.approx(1 / math.sqrt(0.25))
    with pytest.raises(ValueError, match="lr_rule"):
        lr_scale(4, 4, "bogus", 1.0, True)


def test_config_keys_are_the_constructor_vocabulary():
    """Every Dion3Config field is accepted by Dion3 and lands in the param group."""
    opt = Dion3([_param(4, 8)], lr=0.03, fraction=0.5, flavor="normuon", ns_dtype="float32")
    group = opt.param_groups[0]
    for key in Dion3Config.keys():
        assert key in group
    assert group["lr"] == 0.03 and group["fraction"] == 0.5 and group["flavor"] == "normuon"


def test_every_configured_flavor_is_a_strategy() -> None:
    """The config's allowed flavors and the flavor classes are the same set."""
    from dion3_titan.optim.config import FLAVORS as NAMES
    from dion3_titan.optim.flavors import FLAVORS

    assert set(NAMES) == set(FLAVORS)
    assert all(FLAVORS[n].name == n for n in NAMES)
