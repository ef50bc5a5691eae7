"""Split specs (optim/split.py) for torchtitan 0.3's fused weights.

- ``FusedQKVLinear.wqkv`` (llama3, qwen3, gpt_oss): 0.3 lays its rows out per KV group --
  ``heads_per_kv`` query heads, then one key head, then one value head, each ``head_dim`` rows
  -- so Q, K and V are not contiguous blocks and a Q|K|V ``sizes=`` split would mix them. Every
  head is its own piece (``head_dim=<d>``): no piece mixes Q, K or V rows.
- qwen3_5's gated attention ``wq`` (2 x n_heads x head_dim rows: per head, the query then its
  sigmoid gate): pieces of ``head_dim`` rows, a query or a gate of one head each.
- gpt_oss experts ``mlp1_weight_EGD`` (E, 2h, d): gate and up interleaved row by row (its
  SwiGLU reads ``h[..., ::2]`` and ``h[..., 1::2]``) -> ``interleave=2``.
- Anything else named like a fused weight (e.g. a contiguous ``wqkv`` of a plain linear) gets
  ``auto_split_specs``'s generic rules, after the specs above (the first match wins).

deepseek_v3's and kimi's ``wkv_a`` (the compressed KV and the shared RoPE key) stays whole, as
on torchtitan 0.2.
"""

import re

import torch.nn as nn
from torchtitan.models.common.attention import FusedQKVLinear

from dion3_titan.optim.split import auto_split_specs, normalize_specs

_EXPERTS_GATE_UP = re.compile(r"(^|\.)mlp1_weight_[A-Z]+$")


def _escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _glob(name: str) -> str:
    """Layer indices -> ``*``, so one spec covers every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", _escape(name))


def fused_weight_specs(model: nn.Module) -> list[str]:
    """Split specs for the 0.3 fused weights in ``model`` (names as canonical FQNs)."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    specs: dict[str, str] = {}
    for prefix, module in model.named_modules():
        prefix = canonical_fqn(prefix)
        if isinstance(module, FusedQKVLinear):
            specs.setdefault(_glob(f"{prefix}.wqkv.weight"), f"head_dim={module.head_dim}")
        wq = getattr(module, "wq", None)
        heads, head_dim = getattr(module, "n_heads", None), getattr(module, "head_dim", None)
        if (
            isinstance(wq, nn.Linear)
            and isinstance(heads, int)
            and isinstance(head_dim, int)
            and wq.weight.shape[0] == 2 * heads * head_dim
        ):
            specs.setdefault(_glob(f"{prefix}.wq.weight"), f"head_dim={head_dim}")
    for name, p in model.named_parameters():
        name = canonical_fqn(name)
        if _EXPERTS_GATE_UP.search(name) and p.ndim == 3 and p.shape[-2] % 2 == 0:
            specs.setdefault(_glob(name), "interleave=2")
    return [f"pattern={g};{s}" for g, s in specs.items()]


def split_specs_for(model: nn.Module, options: dict, names: list[str]) -> tuple[str, ...]:
    """``split_specs`` of one Dion3 param group: the user's, then (``split_auto``, default True)
    the specs of the fused weights among ``names``."""
    from dion3_titan.optim.split import parse_spec

    user = normalize_specs(options.get("split_specs", ()))
    if not options.get("split_auto", True):
        return user
    by_pattern: dict[str, str] = {}  # the first spec of a pattern wins: 0.3's layouts first
    for spec in (*fused_weight_specs(model), *auto_split_specs(model)):
        parsed = parse_spec(spec)
        if any(parsed.matches(n) for n in names):
            by_pattern.setdefault(parsed.pattern, spec)
    return (*user, *by_pattern.values())
