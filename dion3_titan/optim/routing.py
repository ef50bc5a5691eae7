"""Which parameters Dion3 orthogonalizes and which go to AdamW.

Matrices inside the transformer blocks (attention and MLP projections, 2D) and stacked MoE
experts (3D, a batch of matrices) are orthogonalized. Embeddings, the output head, norms,
biases and anything 1D go to AdamW: their geometry is not that of a linear map between hidden
spaces (paper App. D.1).
"""

import re
from collections.abc import Iterable

import torch

# Wrapper prefixes that activation checkpointing and torch.compile insert into names.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")

# Parameters that are matrices but must not be orthogonalized.
DEFAULT_ADAMW_PATTERNS = (
    r"(^|\.)tok_embeddings\.",
    r"(^|\.)embed",
    r"(^|\.)wte\.",
    r"(^|\.)wpe\.",
    r"(^|\.)output\.",
    r"(^|\.)lm_head\.",
    r"(^|\.)norm",
    r"_norm\.",
    r"\.bias$",
    r"_bias$",  # e.g. gpt_oss experts' mlp1_bias (2D: one bias row per expert)
    r"(^|\.)router\.gate\.",
    r"expert_bias$",
    r"tokens_per_expert$",
)


def clean_name(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def param_class(name: str) -> str:
    """The class of a parameter by its name ("attention", "mlp", "experts" or "other"), for the
    per-class update metrics (optimizer/update_rms/<class>)."""
    if "expert" in name:
        return "experts"
    if "attention" in name or "attn" in name:
        return "attention"
    if "feed_forward" in name or "mlp" in name or "ffn" in name:
        return "mlp"
    return "other"


def is_matrix(name: str, param: torch.Tensor, adamw_patterns: Iterable[str] = DEFAULT_ADAMW_PATTERNS) -> bool:
    """True when ``param`` should be orthogonalized (2D or 3D, not matched by a pattern)."""
    if param.ndim not in (2, 3):
        return False
    name = clean_name(name)
    return not any(re.search(p, name) for p in adamw_patterns)


def build_param_groups(
    named_params: Iterable[tuple[str, torch.Tensor]],
    *,
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.0,
    adamw_patterns: Iterable[str] = DEFAULT_ADAMW_PATTERNS,
) -> list[dict]:
    """Two groups, the matrix group first (a fixed layout keeps LR schedulers aligned):
    ``{"algorithm": "dion3", "params", "names"}`` and ``{"algorithm": "adamw", ...}``.
    Both are always present, possibly empty, so every model part has the same layout.
    ``adamw_lr`` None means the optimizer's base lr."""
    patterns = tuple(adamw_patterns)
    matrices, matrix_names, scalars, scalar_names = [], [], [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if is_matrix(name, p, patterns):
            matrices.append(p)
            matrix_names.append(clean_name(name))
        else:
            scalars.append(p)
            scalar_names.append(clean_name(name))
    adamw = {
        "algorithm": "adamw",
        "params": scalars,
        "names": scalar_names,
        "betas": tuple(adamw_betas),
        "eps": adamw_eps,
        "weight_decay": adamw_weight_decay,
    }
    if adamw_lr is not None:
        adamw["lr"] = adamw_lr
    return [{"algorithm": "dion3", "params": matrices, "names": matrix_names}, adamw]
