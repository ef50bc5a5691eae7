"""torchtitan 0.2's `[optimizer]` extension, named in a TOML as `[job] custom_config_module =
"dion3_titan.job_config"` (that public module re-exports this one).

torchtitan merges this module's `JobConfig` into its own (field by field, recursing into
dataclass-typed fields), so the `Optimizer` below only declares what torchtitan lacks. Its
fields are generated from the optimizers' own config dataclasses (`Dion3Config`, and
`PRMuonConfig` for name = "prmuon"), the one source of key names. Every generated key defaults
to None, meaning "not set": the optimizer named by `name` then applies its own default (Dion3's
and Periodic Row-wise Muon's differ, e.g. `ns_coefficients`), and a key set against the name
("muon" with fraction = 0.5) is told apart from a default. torchtitan's own `lr` and
`weight_decay` are redeclared the same way (default None), because their torchtitan defaults
(8e-4, 0.1) are AdamW's: left out, our names get Dion3's defaults (0.02, 0.0) and every other
name gets torchtitan's (the plugin fills them in before torchtitan's builder runs, so AdamW
jobs are unchanged). Importing this module also registers the plugin (wrapped TrainSpecs,
offline datasets).

No `from __future__ import annotations` here: torchtitan's merge calls `is_dataclass(f.type)`,
which is False for string annotations, and the `[optimizer]` extension would silently replace
torchtitan's section instead of extending it.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config import Optimizer as TitanOptimizer

from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.prmuon import PRMuonConfig
from dion3_titan.titan02 import plugin

# torchtitan keys whose torchtitan defaults are AdamW's: None = unset (see the docstring).
UNSET_TITAN_FIELDS: list[tuple[str, Any, Any]] = [
    ("lr", float | None, field(default=None)),
    ("weight_decay", float | None, field(default=None)),
]

# Keys only the plugin reads (not hyperparameters of the matrix groups).
PLUGIN_FIELDS: list[tuple[str, Any, Any]] = [
    # AdamW learning rate of embeddings/output/norms/biases; unset = `lr` (the matrix lr).
    ("adamw_lr", float | None, field(default=None)),
    # AdamW weight decay of those parameters; unset = 0.0 (weight_decay is the matrices').
    ("adamw_weight_decay", float | None, field(default=None)),
    # Capture the whole optimizer step in a CUDA graph after `cuda_graph_warmup` eager steps
    # (unset: wherever it works, see plugin.py; false: never).
    ("cuda_graph", bool | None, field(default=None)),
    ("cuda_graph_warmup", int | None, field(default=None)),
    # Log optimizer metrics (time, communication, update RMS, selection) at metrics.log_freq.
    ("optimizer_metrics", bool | None, field(default=None)),
]


def _toml_type(f: dataclasses.Field) -> Any:
    """A concrete type torchtitan's CLI parser (tyro) can read, for one config field.

    A few fields are annotated loosely (`tuple`, `object`) because the Python API takes several
    forms. In TOML/CLI: a tuple of ints is an array of ints (TOML arrays are lists), and a
    loosely typed field with a string default (`ns_coefficients`) is that string or an array
    of float arrays (explicit coefficient triples)."""
    if f.type in (bool, int, float, str):
        return f.type
    default = f.default
    if isinstance(default, str):
        return str | list[list[float]]
    if isinstance(default, bool | int | float):
        return type(default)
    if isinstance(default, tuple) and all(isinstance(v, int) for v in default):
        return list[int]
    raise TypeError(f"{f.name}: no TOML type for annotation {f.type!r}")


def optimizer_keys() -> dict[str, Any]:
    """Key -> TOML type of every generated `[optimizer]` key, in declaration order."""
    titan = {f.name for f in dataclasses.fields(TitanOptimizer)}
    out: dict[str, Any] = {}
    for cls in (Dion3Config, PRMuonConfig):
        for f in dataclasses.fields(cls):
            if f.name not in titan and f.name not in out:
                out[f.name] = _toml_type(f)
    return out


Optimizer = dataclasses.make_dataclass(
    "Optimizer",
    [(k, t | None, field(default=None)) for k, t in optimizer_keys().items()] + UNSET_TITAN_FIELDS + PLUGIN_FIELDS,
    namespace={"__module__": __name__},
)
Optimizer.__doc__ = (
    "dion3_titan's [optimizer] keys, named after Dion3Config / PRMuonConfig fields. They apply "
    "when name is 'dion3', 'muon', 'normuon' or 'prmuon' and are ignored by torchtitan's "
    "Adam/AdamW. Unset (None) = the named optimizer's default (lr and weight_decay too)."
)


@dataclass
class JobConfig:
    optimizer: Optimizer = field(default_factory=Optimizer)


plugin.register()
