"""The optimizer names this package adds to torchtitan, and the validation of their options.

One owner for both torchtitan generations: 0.2's `[optimizer] name = "dion3"` (titan02/) and
0.3's `ParamGroupConfig(optimizer_name="Dion3", optimizer_kwargs={...})` (titan03/) resolve
their options here, so a bad value gets the same message in both, naming the key and its
allowed values. torchtitan-free.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.dion3 import Dion3
from dion3_titan.optim.prmuon import FIXED as PRMUON_FIXED
from dion3_titan.optim.prmuon import PeriodicRowwiseMuon, PRMuonConfig


@dataclass(frozen=True)
class Engine:
    """What one optimizer name builds: the optimizer class, the settings the name fixes,
    the keys only this optimizer accepts, whether it orthogonalizes the pieces of fused
    weights separately (optim/split.py; Periodic Row-wise Muon works on whole matrices), and
    why its step cannot be captured in one CUDA graph ("" when it can)."""

    cls: type
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    own_keys: tuple[str, ...] = ()
    splits: bool = True
    no_graph: str = ""


PRMUON_KEYS = tuple(f.name for f in dataclasses.fields(PRMuonConfig))
DION3_KEYS = tuple(f.name for f in dataclasses.fields(Dion3Config))
# "muon"/"normuon" are the Dion3 engine with every row orthogonalized (fraction 1), so they
# are exact Muon/NorMuon; Periodic Row-wise Muon pins fraction 1 and the Muon flavor itself.
NAMES: dict[str, Engine] = {
    "dion3": Engine(Dion3),
    "muon": Engine(Dion3, fixed={"fraction": 1.0, "flavor": "muon"}),
    "normuon": Engine(Dion3, fixed={"fraction": 1.0, "flavor": "normuon"}),
    "prmuon": Engine(
        PeriodicRowwiseMuon,
        fixed=PRMUON_FIXED,
        own_keys=PRMUON_KEYS,
        splits=False,
        no_graph="its refresh and RowNorm steps would need two graphs",
    ),
}


def resolve_options(
    name: str,
    options: dict[str, Any],
    *,
    where: str = "[optimizer]",
    name_key: str = "name",
    spell: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``options`` (only the keys the user set) for optimizer ``name`` (a key of NAMES), with the
    settings the name fixes added; ValueError starting with ``where`` and naming the key and
    its allowed values otherwise. ``name_key``/``spell`` word the messages in the caller's
    vocabulary (0.2: name='dion3'; 0.3: optimizer_name='Dion3')."""
    engine = NAMES[name]

    def say(n: str) -> str:  # a name in the caller's vocabulary
        return repr((spell or {}).get(n, n))

    unknown = [k for k in options if k not in DION3_KEYS + PRMUON_KEYS]
    if unknown:
        raise ValueError(
            f"{where} unknown key(s) {unknown} for {name_key}={say(name)}; allowed keys are "
            f"{sorted(DION3_KEYS + engine.own_keys)}"
        )
    opts = dict(options)
    for key in opts:
        if key in PRMUON_KEYS and key not in engine.own_keys:
            raise ValueError(f"{where} {key}={opts[key]!r} applies only to {name_key}={say('prmuon')}, not {say(name)}")
    for key, forced in engine.fixed.items():
        if key in opts and opts[key] != forced:
            raise ValueError(
                f"{where} {key}={opts[key]!r} conflicts with {name_key}={say(name)}, which fixes "
                f"{key}={forced!r}; use {name_key}={say('dion3')} to choose {key} freely"
            )
        opts[key] = forced
    try:  # validates every key once, before any model is built
        Dion3Config(**{k: v for k, v in opts.items() if k in DION3_KEYS})
        if engine.own_keys:
            PRMuonConfig(**{k: v for k, v in opts.items() if k in engine.own_keys})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where} {e}") from e
    return opts
