"""Dion3 hyperparameters: one dataclass, validated once.

The field names are the vocabulary everywhere: the standalone constructor, param-group keys and
the TOML keys under ``[optimizer]`` all use them.
"""

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from dion3_titan.kernels.dispatch import PREFERENCES

FLAVORS = ("muon", "normuon")
LR_RULES = ("spectral", "rms", "none")
NS_ALGORITHMS = ("gram", "standard", "auto")
NS_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
SELECTIONS = ("l1", "random")
SELECTION_SCOPES = ("local", "global")
SELECTION_DIMS = ("rows", "cols")
BACKENDS = PREFERENCES  # kernels/dispatch.py owns the backend names
NONFINITE = ("raise", "skip")
REPLICATE_SYNCS = ("gradients", "compressed")
REPLICATE_NS = ("repeat", "split")

# Muon's fixed quintic (Jordan et al.), used at every step.
MUON_QUINTIC = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al.) optimal odd quintics for singular values in [1e-3, 1], one per
# step, before the safety factor is applied. Later steps repeat the converged polynomial.
POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
COEFFICIENT_SETS = ("polar_express", "muon")

Coefficients = tuple[tuple[float, float, float], ...]


def coefficient_schedule(name_or_values, steps: int, safety_factor: float) -> Coefficients:
    """The (a, b, c) of each step. For Polar Express, ``safety_factor`` s rescales p(x) ->
    p(x / s) so singular values up to s (rounding can push them above 1) still converge
    (paper App. B.2.2). "muon" is Muon's quintic exactly, and explicit triples are used as
    given: the factor belongs to Polar Express only."""
    if isinstance(name_or_values, str):
        if name_or_values == "muon":
            return (MUON_QUINTIC,) * steps
        if name_or_values == "polar_express":
            s = safety_factor
            base = [POLAR_EXPRESS[min(t, len(POLAR_EXPRESS) - 1)] for t in range(steps)]
            return tuple((a / s, b / s**3, c / s**5) for a, b, c in base)
        raise ValueError(
            f"ns_coefficients={name_or_values!r}: allowed values are {COEFFICIENT_SETS} "
            "or an explicit list of (a, b, c) triples"
        )
    values = tuple(tuple(float(v) for v in abc) for abc in name_or_values)
    if not values or any(len(abc) != 3 for abc in values):
        raise ValueError("ns_coefficients: an explicit value must be a non-empty list of (a, b, c) triples")
    return values


def _check_choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: allowed values are {tuple(allowed)}")


# What a step reads from its param group every time (torch's convention: set them between steps;
# a checkpoint restores them). Every other key is fixed at construction: the megabatch plan, the
# Newton-Schulz settings and the kernels' per-matrix scales are built from it.
LIVE_KEYS: tuple[str, ...] = ("lr", "weight_decay", "momentum")


@dataclass
class Dion3Config:
    """Hyperparameters of the matrix (Dion3) groups. AdamW groups take lr/betas/eps/weight_decay."""

    lr: float = 0.02
    fraction: float = 1.0  # f in (0, 1]: share of rows orthogonalized per step; 1.0 is Muon/NorMuon
    flavor: str = "muon"  # "muon" or "normuon" (row-wise second-moment normalization)
    momentum: float = 0.95  # mu: selected momentum rows decay by mu after each step
    normuon_beta2: float = 0.95  # NorMuon's row second-moment EMA factor
    normuon_eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled, every row: W *= 1 - lr' * weight_decay (lr' = transferred lr)
    lr_rule: str = "spectral"  # "spectral": lr*sqrt(d_out/d_in); "rms": lr*0.2*sqrt(max dim); "none"
    fraction_lr_transfer: bool = True  # lr' = lr / sqrt(f) for the update and the weight decay
    ns_algorithm: str = "auto"  # "gram" | "standard" | "auto" (gram for rectangular, standard for square)
    ns_coefficients: object = "polar_express"  # "polar_express" | "muon" | [(a, b, c), ...]
    ns_steps: int = 5
    ns_restarts: tuple = (2,)  # Gram NS restarts after these iterations
    ns_safety_factor: float = 1.05  # Polar Express only (see coefficient_schedule)
    ns_dtype: str = "float16"
    ns_eps: float = 1e-7
    selection: str = "l1"  # "l1" (largest row l1 norms) or "random"
    selection_scope: str = "local"  # "local": top rows of each shard; "global": of the whole matrix
    # "rows": select rows of W (dim -2, output neurons; what NorMuon normalizes); "cols": dim -1.
    # Never chosen from the sharding, so one process and N ranks run the same algorithm.
    selection_dim: str = "rows"
    backend: str = "auto"  # kernels: "auto" | "torch" | "triton" | "cute"
    megabatch: bool = True  # one batch (and one collective each way) per shape group; False:
    # batches of as many matrices as the shards of each (for comparisons, paper Table 1)
    nonfinite: str = "raise"  # non-finite gradients: "raise" names the parameters; "skip" skips the step
    seed: int = 0  # random selection's generator seed
    # Across HSDP replicas (docs/distributed.md): "gradients" (FSDP2 all-reduces every gradient
    # across them) or "compressed" (each replica keeps its own momentum; only the selected rows'
    # mean crosses, and each replica orthogonalizes a share of every shape group).
    replicate_sync: str = "gradients"
    # With "gradients": "repeat" (every replica orthogonalizes every matrix) or "split" (each a
    # share, results all-gathered: fewer NS FLOPs for more bytes across replicas).
    replicate_ns: str = "repeat"
    # One process on a GPU: the shape group with the most Newton-Schulz FLOPs runs its pipeline
    # on a CUDA stream of its own, beside the other groups' where theirs are small (optim/
    # overlap.py); false runs every group on the step's stream, one after another.
    ns_overlap: bool = True
    # Fused-weight splitting (optim/split.py, docs/splitting.md): pieces of a parameter that are
    # orthogonalized as separate matrices. One string, specs joined by "|" (the Python API also
    # takes a list), e.g. "pattern=layers.*.attention.wqkv.weight;sizes=512,128,128".
    split_specs: str = ""
    split_heads: int = 0  # H > 0: split the params matching split_heads_pattern into H row blocks
    split_heads_pattern: str = "*.attention.wq.weight"  # glob(s) on param names, "|"-separated
    split_auto: bool = True  # torchtitan plugin: add auto_split_specs(model) after split_specs

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.fraction, (int, float)) or not (0.0 < self.fraction <= 1.0):
            raise ValueError(f"fraction={self.fraction!r}: must be a number in (0, 1]")
        if not (self.lr >= 0.0):
            raise ValueError(f"lr={self.lr!r}: must be >= 0")
        if not (0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum={self.momentum!r}: must be in [0, 1)")
        if not (0.0 <= self.normuon_beta2 < 1.0):
            raise ValueError(f"normuon_beta2={self.normuon_beta2!r}: must be in [0, 1)")
        if not (self.weight_decay >= 0.0):
            raise ValueError(f"weight_decay={self.weight_decay!r}: must be >= 0")
        _check_choice("flavor", self.flavor, FLAVORS)
        _check_choice("lr_rule", self.lr_rule, LR_RULES)
        _check_choice("ns_algorithm", self.ns_algorithm, NS_ALGORITHMS)
        _check_choice("ns_dtype", self.ns_dtype, NS_DTYPES)
        _check_choice("selection", self.selection, SELECTIONS)
        _check_choice("selection_scope", self.selection_scope, SELECTION_SCOPES)
        _check_choice("selection_dim", self.selection_dim, SELECTION_DIMS)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("nonfinite", self.nonfinite, NONFINITE)
        _check_choice("replicate_sync", self.replicate_sync, REPLICATE_SYNCS)
        _check_choice("replicate_ns", self.replicate_ns, REPLICATE_NS)
        if not isinstance(self.ns_steps, int) or self.ns_steps < 1:
            raise ValueError(f"ns_steps={self.ns_steps!r}: must be an integer >= 1")
        self.ns_restarts = tuple(int(r) for r in self.ns_restarts)
        if any(not (0 < r < self.ns_steps) for r in self.ns_restarts):
            raise ValueError(
                f"ns_restarts={self.ns_restarts!r}: each restart must be an iteration in 1..{self.ns_steps - 1}"
            )
        if not (self.ns_safety_factor >= 1.0):
            raise ValueError(f"ns_safety_factor={self.ns_safety_factor!r}: must be >= 1")
        self.coefficients()  # validates ns_coefficients
        from dion3_titan.optim.split import normalize_specs

        self.split_specs = normalize_specs(self.split_specs)  # ValueError naming split_specs[i]
        if isinstance(self.split_heads, bool) or not isinstance(self.split_heads, int) or self.split_heads < 0:
            raise ValueError(f"split_heads={self.split_heads!r}: must be an integer >= 0 (0: off)")
        if not isinstance(self.split_heads_pattern, str) or (self.split_heads and not self.split_heads_pattern.strip()):
            raise ValueError(
                f"split_heads_pattern={self.split_heads_pattern!r}: must be a glob on parameter names "
                "(several joined by '|'), e.g. '*.attention.wq.weight'"
            )
        if not isinstance(self.ns_overlap, bool):
            raise ValueError(f"ns_overlap={self.ns_overlap!r}: must be true or false")
        if not isinstance(self.split_auto, bool):
            raise ValueError(f"split_auto={self.split_auto!r}: must be true or false")

    def coefficients(self) -> Coefficients:
        coeffs = coefficient_schedule(self.ns_coefficients, self.ns_steps, self.ns_safety_factor)
        if len(coeffs) != self.ns_steps and not isinstance(self.ns_coefficients, str):
            raise ValueError(f"ns_coefficients: {len(coeffs)} explicit triples given but ns_steps={self.ns_steps}")
        return coeffs

    @property
    def compute_dtype(self) -> torch.dtype:
        return NS_DTYPES[self.ns_dtype]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# AdamW's hyperparameters and what each must be (torch.optim.AdamW's rules)
_ADAMW_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "lr": (">= 0", lambda v: v >= 0.0),
    "beta1": ("in [0, 1)", lambda v: 0.0 <= v < 1.0),
    "beta2": ("in [0, 1)", lambda v: 0.0 <= v < 1.0),
    "eps": (">= 0", lambda v: v >= 0.0),
    "weight_decay": (">= 0", lambda v: v >= 0.0),
}


def check_adamw(values: dict[str, object], where: str = "", spell: dict[str, str] | None = None) -> None:
    """The AdamW hyperparameters given (keys of lr, beta1, beta2, eps, weight_decay) with
    torch.optim.AdamW's rules: the step calls the functional adamw, which checks none of them.
    ValueError naming the key as ``spell`` spells it (else as above), after ``where``."""
    for key, value in values.items():
        text, ok = _ADAMW_RULES[key]
        try:
            good = not isinstance(value, bool) and ok(float(value))
        except (TypeError, ValueError):
            good = False
        if not good:
            raise ValueError(f"{where}{(spell or {}).get(key, key)}={value!r}: must be a number {text}")


def fraction_transfer(fraction: float, transfer: bool) -> float:
    """The one place the fraction's learning-rate transfer is defined: lr' = lr * this.

    With ``transfer``, f * rows orthogonal rows carry the Frobenius norm of a full update when
    the learning rate is divided by sqrt(f) (paper Sec. 8.1). lr' is the learning rate of the
    paper's Alg. 4, so it scales both the update and the decoupled weight decay (line 8), as in
    microsoft/dion, whose users pass lr' itself.
    """
    return 1.0 / math.sqrt(fraction) if transfer else 1.0


def lr_scale(d_out: int, d_in: int, rule: str, fraction: float, transfer: bool) -> float:
    """The one place the matrix learning-rate multiplier is defined.

    The update of a d_out x d_in matrix is ``lr * lr_scale(...) * O``: the shape rule times
    ``fraction_transfer``. Weight decay takes only the transfer (``fraction_transfer``).
    """
    if rule == "spectral":
        scale = math.sqrt(d_out / d_in)
    elif rule == "rms":
        scale = 0.2 * math.sqrt(max(d_out, d_in))
    elif rule == "none":
        scale = 1.0
    else:
        raise ValueError(f"lr_rule={rule!r}: allowed values are {LR_RULES}")
    return scale * fraction_transfer(fraction, transfer)
