"""The runs of scripts/quality_run.py (one optimizer setting each; benchmarks/quality_run.py
lists them) and the optimizer each one builds on the model's parameters."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from dion3_titan.optim.dion3 import Dion3
from dion3_titan.optim.routing import build_param_groups

MATRIX_LR = 0.02  # default base lr of the Muon-family runs; other values tag run names "_lr..."
MOMENTUM = 0.95  # default momentum of the Muon-family runs; other values tag run names "_mu..."


@dataclass
class RunSpec:
    name: str
    kind: str  # "adamw" | "torch_muon" | "dion3" | "prmuon" | "ms_dion3"
    lr: float  # peak lr of the matrices (AdamW runs: of everything)
    options: dict = field(default_factory=dict)  # extra constructor keywords
    label: str = ""  # one line for tables and legends


class Steppable(Protocol):
    """What the training loop needs of an optimizer (Combined and GraphedOptimizer are not
    torch.optim.Optimizer subclasses)."""

    param_groups: list[dict]

    def step(self) -> object: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class Combined:
    """Two optimizers stepped as one (torch Muon for matrices + AdamW for the rest)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    groups = build_param_groups(model.named_parameters())
    return groups[0]["params"], groups[1]["params"]


def make_optimizer(spec: RunSpec, model: nn.Module, args: argparse.Namespace, fused: bool) -> Steppable:
    """The optimizer of one run. AdamW groups in every run use betas (0.9, 0.95)."""
    betas = (0.9, 0.95)
    if spec.kind == "adamw":
        matrices, scalars = split_params(model)
        groups = [
            {"params": matrices, "weight_decay": args.adamw_weight_decay},
            {"params": scalars, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=spec.lr, betas=betas, eps=1e-8, fused=fused)
    if spec.kind == "torch_muon":
        matrices, scalars = split_params(model)
        muon = torch.optim.Muon(
            matrices, lr=spec.lr, momentum=args.momentum, weight_decay=args.matrix_weight_decay, **spec.options
        )
        adamw = torch.optim.AdamW(scalars, lr=args.scalar_lr, betas=betas, weight_decay=0.0, fused=fused)
        return Combined(muon, adamw)
    if spec.kind == "ms_dion3":
        from dion import Dion3 as MsDion3

        matrices, scalars = split_params(model)
        groups = [
            {"params": matrices},
            {"params": scalars, "algorithm": "adamw", "lr": args.scalar_lr, "weight_decay": 0.0},
        ]
        return MsDion3(
            groups,
            lr=spec.lr,
            mu=args.momentum,
            weight_decay=args.matrix_weight_decay,
            betas=betas,
            epsilon=1e-8,
            **spec.options,
        )
    groups = build_param_groups(
        model.named_parameters(), adamw_lr=args.scalar_lr, adamw_betas=betas, adamw_weight_decay=0.0
    )
    common = {"momentum": args.momentum, "weight_decay": args.matrix_weight_decay, **spec.options}
    if spec.kind == "dion3":
        opt = Dion3(groups, lr=spec.lr, **common)
        if args.cuda_graph and torch.cuda.is_available():
            from dion3_titan.optim.cuda_graph import GraphedOptimizer

            return GraphedOptimizer(opt)
        return opt
    if spec.kind == "prmuon":
        from dion3_titan.optim.prmuon import PeriodicRowwiseMuon

        return PeriodicRowwiseMuon(groups, lr=spec.lr, **common)
    raise ValueError(f"unknown run kind {spec.kind!r}")


def missing(kind: str) -> str | None:
    """Why runs of ``kind`` cannot be made here (an optional import fails), else None."""
    try:
        if kind == "prmuon":
            from dion3_titan.optim.prmuon import PeriodicRowwiseMuon  # noqa: F401
        elif kind == "ms_dion3":
            from dion import Dion3  # noqa: F401
    except Exception as e:  # an optional or in-progress module may fail in any way: report, don't crash
        return f"{type(e).__name__}: {e}"
    return None


def default_runs(args: argparse.Namespace) -> list[RunSpec]:
    """Every run, in order. Each orthogonalizing run is repeated per ``--matrix-lrs`` value
    (names get ``_lr``/``_mu`` suffixes off the defaults); ``--runs`` picks by name prefix."""
    runs = [RunSpec(f"adamw_lr{lr:g}", "adamw", lr, label=f"AdamW, lr {lr:g}") for lr in args.adamw_lrs]
    f = args.fraction
    plain = {"fraction": 1.0, "ns_algorithm": "standard", "ns_coefficients": "muon"}
    several = len(args.matrix_lrs) > 1
    for lr in args.matrix_lrs:
        tag = f"_lr{lr:g}" if several or lr != MATRIX_LR else ""
        tag += f"_mu{args.momentum:g}" if args.momentum != MOMENTUM else ""
        if hasattr(torch.optim, "Muon"):
            runs.append(
                RunSpec(
                    f"muon_torch{tag}",
                    "torch_muon",
                    lr,
                    label="torch.optim.Muon (Nesterov, NS5 Muon quintic, lr x sqrt(max(1, out/in)))",
                )
            )
        for flavor, prefix in (("muon", "dion3"), ("normuon", "dion3n")):
            name = flavor.capitalize().replace("Normuon", "NorMuon")
            runs += [
                # The baseline: the textbook rule (tests/test_dion3_core.py checks our engine
                # at f=1 against it step by step) with Muon's own NS5 and lr rule sqrt(out/in).
                RunSpec(
                    f"{flavor}_plain{tag}",
                    "dion3",
                    lr,
                    {**plain, "flavor": flavor},
                    f"{name}: every row, standard NS5 with Muon's quintic, lr x sqrt(out/in)",
                ),
                RunSpec(
                    f"{prefix}_f1_standard{tag}",
                    "dion3",
                    lr,
                    {"fraction": 1.0, "ns_algorithm": "standard", "flavor": flavor},
                    f"Dion3 ({flavor}) f=1, standard NS, Polar Express",
                ),
                RunSpec(
                    f"{prefix}_f1_gram{tag}",
                    "dion3",
                    lr,
                    {"fraction": 1.0, "ns_algorithm": "gram", "flavor": flavor},
                    f"Dion3 ({flavor}) f=1, Gram NS, Polar Express",
                ),
                RunSpec(
                    f"{prefix}_f{f:g}{tag}",
                    "dion3",
                    lr,
                    {"fraction": f, "flavor": flavor},
                    f"Dion3 ({flavor}) f={f:g}, lr/sqrt(f), NS auto",
                ),
            ]
        runs.append(
            RunSpec(
                f"msdion3n_f{f:g}{tag}",
                "ms_dion3",
                lr / math.sqrt(f),
                {"fraction": f},
                f"microsoft/dion Dion3 (normuon) f={f:g}, its lr = base lr/sqrt(f)",
            )
        )
        runs.append(
            RunSpec(f"prmuon{tag}", "prmuon", lr, label="Periodic Row-wise Muon (defaults: K=3, gamma=0.15, NS5)")
        )
    if not args.runs:
        return [r for r in runs if r.kind != "ms_dion3"]
    wanted = args.runs.split(",")
    return [r for r in runs if any(r.name.startswith(w) for w in wanted)]
