"""The parameter list the comm model works on: a model's parameters as the optimizer sees them.

torchtitan's own model definitions (its TrainSpec registry, model args updated from a default
JobConfig as the trainer does) are built on the meta device, so nothing is allocated, and
routed by the package's rules: ``build_param_groups`` (Dion3 matrices vs AdamW) and the split
pieces ``split_pieces`` cuts under the plugin's ``with_auto_split_specs``. A small custom
``nn.Module`` goes through the same routing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.routing import build_param_groups
from dion3_titan.optim.split import split_pieces, with_auto_split_specs

# --model name -> (torchtitan model name, flavor)
TITAN_MODELS = {
    "llama3-8b": ("llama3", "8B"),
    "llama3-70b": ("llama3", "70B"),
    "deepseek_v3-16b": ("deepseek_v3", "16B"),
}

# torchtitan's FSDP wrapping (apply_fsdp): the unit of the final norm and output head is not
# resharded after forward (its parameters are all-gathered once per step), every other unit is.
_NOT_RESHARDED = ("norm.", "output.")


@dataclass(frozen=True)
class Param:
    """One parameter: its routing and what FSDP2 does with it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    matrix: bool  # orthogonalized by Dion3 (else AdamW)
    pieces: tuple[slice, ...] | None = None  # split pieces of dim -2 (None: the whole matrix)
    gathers: int = 2  # FSDP2 parameter all-gathers per step (forward, and again in backward)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def titan_model(name: str) -> nn.Module:
    """torchtitan's model ``name`` (a key of TITAN_MODELS) on the meta device."""
    from torchtitan.config import JobConfig
    from torchtitan.protocols.train_spec import get_train_spec

    if name not in TITAN_MODELS:
        raise ValueError(f"model {name!r}: allowed values are {tuple(TITAN_MODELS)}")
    titan_name, flavor = TITAN_MODELS[name]
    spec = get_train_spec(titan_name)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(JobConfig())
    with torch.device("meta"):
        return spec.model_cls(args)


def routed_params(model: nn.Module, cfg: Dion3Config, split_auto: bool = True) -> list[Param]:
    """``model``'s trainable parameters in named_parameters order, routed as the plugin routes
    them (Dion3OptimizersContainer): matrices and their split pieces under ``cfg`` plus the
    automatic specs of ``model``'s fused weights (``split_auto``)."""
    groups = build_param_groups(model.named_parameters())
    options = with_auto_split_specs(cfg.as_dict(), model) if split_auto else cfg.as_dict()
    split_cfg = Dion3Config(**options)
    matrices = {id(p): n for p, n in zip(groups[0]["params"], groups[0]["names"])}
    out = []
    for raw, p in model.named_parameters():
        if not p.requires_grad:
            continue
        gathers = 1 if raw.startswith(_NOT_RESHARDED) else 2
        name = matrices.get(id(p))
        if name is None:
            out.append(Param(raw, tuple(p.shape), p.dtype, False, gathers=gathers))
            continue
        pieces = split_pieces(name, tuple(p.shape), split_cfg)
        out.append(Param(name, tuple(p.shape), p.dtype, True, None if pieces is None else tuple(pieces), gathers))
    return out


def parse_shapes(text: str) -> nn.Module:
    """A custom model from ``"w=64x128,e=4x8x24,norm=64"`` (names ending in "norm", 1D tensors
    and the other AdamW patterns of routing.py go to AdamW), on the meta device."""
    model = nn.Module()
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, dims = item.partition("=")
        if not eq:
            raise ValueError(f"--shapes item {item!r}: expected name=AxB[xC]")
        shape = tuple(int(d) for d in dims.lower().split("x"))
        model.register_parameter(name.strip(), nn.Parameter(torch.empty(shape, device="meta")))
    return model
