"""The configurations scripts/bench_step.py times (benchmarks/step.py says what each row is):
ours, adding one contribution at a time, and microsoft/dion's counterparts when it imports; the
order they run in, and how long each should take."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fnmatch
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field

MATRIX_LR = 0.02
ADAMW_LR = 3e-4
WEIGHT_DECAY = 0.01
GRAPH_WARMUP = 3  # GraphedOptimizer's eager steps before it captures


@dataclass
class BenchConfig:
    name: str
    label: str
    kind: str  # "adamw" | "torch_muon" | "dion3" | "anchor" (microsoft/dion)
    options: dict = field(default_factory=dict)  # Dion3 (or the anchor class's) keyword arguments
    graph: bool = False
    # each step is handed the gradients' total norm first, as torchtitan's gradient clipping
    # does (dion3_titan/clipping.py), so Dion3 makes no finiteness pass of its own
    given_norm: bool = False
    # module attributes set while this row runs (``--settings``): (module, attribute, value)
    settings: tuple[tuple[str, str, object], ...] = ()


def build_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """AdamW, torch.optim.Muon, Muon on our engine, then Dion3 adding one contribution at a
    time (paper Fig. 1 / Table 5 order), each Dion3 step with and without a CUDA graph, and
    Dion3 f = 1 without megabatching (Table 1)."""
    wd = {"weight_decay": args.weight_decay}  # every row's, ours and the baselines' alike
    base = {"flavor": args.flavor, **wd}
    muon = {
        **base,
        "fraction": 1.0,
        "ns_algorithm": "standard",
        "ns_coefficients": "muon",
        "ns_dtype": "bfloat16",
        "backend": "torch",
        "megabatch": False,
    }
    f1_torch = {**base, "fraction": 1.0, "ns_algorithm": "standard", "backend": "torch"}
    f1_kernels = {**f1_torch, "backend": args.kernels}
    gram = {**f1_kernels, "ns_algorithm": args.gram_algorithm}
    configs = [
        BenchConfig(
            "adamw", "AdamW (torch fused)" if args.device == "cuda" else "AdamW (torch foreach)", "adamw", dict(wd)
        ),
        BenchConfig("muon_torch", "torch.optim.Muon (per matrix, NS5 bf16)", "torch_muon", dict(wd)),
        BenchConfig("muon", "Muon: standard NS5, torch, no megabatch", "dion3", muon),
    ]
    stack = [
        ("dion3_f1_torch", "Dion3 f=1: standard NS (polar express), torch", f1_torch),
        ("dion3_f1_kernels", f"+ kernels ({args.kernels})", f1_kernels),
        ("dion3_f1_gram", f"+ Gram NS ({args.gram_algorithm})", gram),
        ("dion3_f1/2", "+ f=1/2", {**gram, "fraction": 0.5}),
        ("dion3_f1/4", "+ f=1/4", {**gram, "fraction": 0.25}),
    ]
    for name, label, options in stack:
        configs.append(BenchConfig(name, label, "dion3", options))
        configs.append(BenchConfig(name + "+graph", label + " + CUDA graph", "dion3", options, graph=True))
        if name in ("dion3_f1/4", "dion3_f1_gram"):
            configs.append(
                BenchConfig(
                    name + "+graph+norm",
                    label + " + CUDA graph, gradient norm given (as under torchtitan with clipping)",
                    "dion3",
                    options,
                    graph=True,
                    given_norm=True,
                )
            )
        if name == "dion3_f1/4":
            configs.append(
                BenchConfig(
                    name + "+graph+norm+1stream",
                    label + " + CUDA graph, gradient norm given, every group on one stream (ns_overlap = false)",
                    "dion3",
                    {**options, "ns_overlap": False},
                    graph=True,
                    given_norm=True,
                )
            )
        if name == "dion3_f1_torch":
            configs.append(
                BenchConfig(
                    "dion3_f1_torch_nomb",
                    "Dion3 f=1 torch, megabatch off (Table 1)",
                    "dion3",
                    {**f1_torch, "megabatch": False},
                )
            )
    configs += anchor_configs(args)
    if args.only:
        patterns = args.only.split(",")
        configs = [c for c in configs if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    return with_settings(configs, getattr(args, "settings", ""))


def parse_setting(text: str) -> tuple[str, str, object]:
    """ "cute_symm.GENERAL=0" -> ("dion3_titan.kernels.cute_symm", "GENERAL", 0): a module of
    dion3_titan (by its dotted name, or its last part under kernels/ or optim/), an attribute it
    has, a Python literal. One clear line for anything else."""
    target, sep, value = text.partition("=")
    module_name, _, attr = target.strip().rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"--settings: {text!r} is not MODULE.ATTRIBUTE=VALUE (e.g. cute_symm.GENERAL=0)")
    candidates = (
        [module_name]
        if module_name.startswith("dion3_titan.")
        else [f"dion3_titan.kernels.{module_name}", f"dion3_titan.optim.{module_name}"]
    )
    for candidate in candidates:
        try:
            module = importlib.import_module(candidate)
        except ModuleNotFoundError:
            continue
        if not hasattr(module, attr):
            raise ValueError(f"--settings: {candidate} has no attribute {attr!r} (in {text!r})")
        try:
            return candidate, attr, ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--settings: the value in {text!r} is not a Python literal") from None
    raise ValueError(f"--settings: no module {module_name!r} under dion3_titan, dion3_titan.kernels or .optim")


def with_settings(configs: list[BenchConfig], spec: str) -> list[BenchConfig]:
    """``configs`` and, for each variant of ``spec`` (comma-separated; a variant is one or more
    MODULE.ATTRIBUTE=VALUE joined by "+"), a copy of each of our Dion3 rows that runs under it,
    named "<row>[<variant>]" and placed after its row, so the two run in one process."""
    variants = [v.strip() for v in spec.split(",") if v.strip()]
    parsed = {v: tuple(parse_setting(part) for part in v.split("+")) for v in variants}
    out = []
    for cfg in configs:
        out.append(cfg)
        if cfg.kind == "dion3":
            out += [dataclasses.replace(cfg, name=f"{cfg.name}[{v}]", settings=parsed[v]) for v in variants]
    return out


def base_name(name: str) -> str:
    """A row's name without its ``--settings`` variant."""
    return name.split("[", 1)[0]


@contextlib.contextmanager
def applied(settings: tuple[tuple[str, str, object], ...]) -> Iterator[None]:
    """The module attributes of ``settings`` set, then restored."""
    saved = []
    try:
        for module_name, attr, value in settings:
            module = importlib.import_module(module_name)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


# microsoft/dion (the paper authors' code), timed beside ours when ``import dion`` works.
# Its Dion3 is the NorMuon flavor (NorDion2); Dion2 is the same algorithm in the Muon flavor.
ANCHOR_CLASS = {"normuon": "Dion3", "muon": "Dion2"}
ANCHOR_FAST = {"use_gram_newton_schulz": True, "use_triton": True}


def anchor_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """dion.Muon (Gram NS + kernels) and dion's Dion3-family optimizer of this flavor at f = 1,
    1/2 and 1/4, each eager and under dion's own CudaGraphOptimizer; none when ``import dion``
    fails (a note says so)."""
    if anchor_module()[0] is None:
        return []
    import importlib.util

    fast, ns = dict(ANCHOR_FAST), "Gram NS + kernels"
    if importlib.util.find_spec("cutlass") is None:  # its Gram NS runs on quack's CuteDSL kernels
        fast["use_gram_newton_schulz"], ns = False, "standard NS + Triton kernels (no CuteDSL here)"
    cls = ANCHOR_CLASS[args.flavor]
    rows = [("dion_muon", f"microsoft/dion Muon ({ns})", "Muon", dict(fast))]
    for tag, f in (("f1", 1.0), ("f1/2", 0.5), ("f1/4", 0.25)):
        rows.append(
            (
                f"dion_{tag}",
                f"microsoft/dion {cls} {tag.replace('f', 'f=')} ({ns})",
                cls,
                {**fast, "fraction": f, "triton_post_ortho": True},
            )
        )
    out = []
    for name, label, cls_name, kw in rows:
        options = {"class": cls_name, "weight_decay": args.weight_decay, **kw}
        out.append(BenchConfig(name, label, "anchor", options))
        out.append(BenchConfig(name + "+graph", label + " + its CUDA graph", "anchor", options, graph=True))
    return out


def anchor_module() -> tuple[object | None, str]:
    """(the ``dion`` package, "") or (None, why it cannot be imported)."""
    try:
        import dion
    except Exception as exc:
        return None, f"import dion failed: {type(exc).__name__}: {str(exc)[:120]}"
    return dion, ""


# Each of our rows and the anchor row it is compared with (same f, same graph setting).
ANCHOR_PAIRS = {"dion3_f1_gram": "dion_f1", "dion3_f1/2": "dion_f1/2", "dion3_f1/4": "dion_f1/4"}


def anchor_of(name: str, flavor: str) -> str | None:
    # the anchor makes no finiteness pass and runs on one stream either way
    name = base_name(name).removesuffix("+1stream").removesuffix("+norm")
    base, graph = name.removesuffix("+graph"), name.endswith("+graph")
    pair = ANCHOR_PAIRS.get(base)
    if pair is None and base == "muon":
        pair = "dion_muon"
    if pair == "dion_f1" and flavor == "muon":
        pair = "dion_muon"  # Muon flavor at f = 1: the authors' Muon
    return None if pair is None else pair + ("+graph" if graph else "")


def run_priority(cfg: BenchConfig) -> int:
    """Execution order (the table keeps the paper's order): the eager stack first, then the
    graph rows, then the extra baselines, so a ``--budget-s`` cut drops the least essential."""
    if cfg.graph:
        return 1
    if cfg.name in ("muon_torch", "dion3_f1_torch_nomb"):
        return 2
    return 0


def estimate_s(cfg: BenchConfig, walls: dict[str, float]) -> float:
    """Seconds a configuration should take, from a measured twin (0 when none ran yet): a
    graph row costs what its eager row did (+10% for its longer warm-up); the extra baselines
    what the rows they extend did."""
    name = base_name(cfg.name)
    twin = {"muon_torch": "muon", "dion3_f1_torch_nomb": "dion3_f1_torch"}.get(
        name, name.removesuffix("+norm").removesuffix("+graph")
    )
    return 1.1 * walls.get(twin, 0.0) if twin != cfg.name else 0.0
