"""Fused-weight split specs: orthogonalize the pieces of a fused parameter separately.

Paper App. A.1.1: Q, K and V (and SwiGLU's gate and up) play different roles, so their fused
matrix [W_Q | W_K | W_V] is orthogonalized piece by piece; optionally by attention head. Every
piece is a row slice ``slice(start, stop, step)`` of dim -2 of the parameter, so on every rank
it is a *view* of the local shard (no copy; updates write through). Each piece is its own
matrix for row selection (its own k), the lr rule (its own d_out x d_in) and the megabatch
plan (pieces of equal shape, across layers, batch together). See docs/splitting.md.

A spec is one string of ``key=value`` fields separated by ``;``::

    pattern=layers.*.attention.wqkv.weight;sizes=512,128,128   # contiguous Q|K|V (GQA sizes)
    pattern=*.feed_forward.w13.weight;chunks=2                  # contiguous gate|up halves
    pattern=*.moe.experts.mlp1_weight;interleave=2              # gate/up interleaved rows
    pattern=*.attention.wq.weight;heads=16                      # 16 per-head blocks
    pattern=*.attention.wqkv.weight;sizes=512,128,128;head_dim=64   # Q|K|V, then by head

``pattern`` is a glob (fnmatch, ``*`` crosses dots) on the parameter's name (as routing.py
cleans it). At most one of sizes/chunks/interleave, then optionally heads (one count, or one
per piece) or head_dim. The first spec whose pattern matches a parameter wins.
"""

import fnmatch
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

ALLOWED_FORMS = (
    "'pattern=<glob>;sizes=<n1>,<n2>[,...]' | 'pattern=<glob>;chunks=<n>' | "
    "'pattern=<glob>;interleave=<n>' | 'pattern=<glob>;heads=<H>[,<H2>,...]' | "
    "'pattern=<glob>;head_dim=<d>' (sizes/chunks/interleave may be followed by ';heads=' or "
    "';head_dim='); several specs: a list, or one string joined by '|'"
)
_KEYS = ("pattern", "sizes", "chunks", "interleave", "heads", "head_dim")


@dataclass(frozen=True)
class SplitSpec:
    text: str
    pattern: str
    sizes: tuple[int, ...] | None = None  # contiguous pieces of these row counts (sum = rows)
    chunks: int | None = None  # n equal contiguous pieces
    interleave: int | None = None  # piece i = rows i, i + n, i + 2n, ...
    heads: tuple[int, ...] | None = None  # each piece cut into this many row blocks (one value
    # for every piece, or one per piece)
    head_dim: int | None = None  # each piece cut into blocks of this many rows

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def pieces(self, rows: int, where: str = "") -> list[slice]:
        """The row slices (dim -2) this spec cuts ``rows`` rows into, in order."""

        def bad(msg: str) -> ValueError:
            return ValueError(f"split spec {self.text!r}{where}: {msg}")

        if self.sizes is not None:
            if sum(self.sizes) != rows:
                raise bad(f"sizes sum to {sum(self.sizes)} but dim -2 has {rows} rows")
            base, start = [], 0
            for n in self.sizes:
                base.append(slice(start, start + n, 1))
                start += n
        elif self.chunks is not None or self.interleave is not None:
            n = self.chunks or self.interleave
            if rows % n:
                raise bad(f"{rows} rows of dim -2 do not divide into {n} pieces")
            size = rows // n
            if self.chunks is not None:
                base = [slice(i * size, (i + 1) * size, 1) for i in range(n)]
            else:
                base = [slice(i, i + (size - 1) * n + 1, n) for i in range(n)]
        else:
            base = [slice(0, rows, 1)]
        if self.heads is None and self.head_dim is None:
            return base
        if self.heads is not None and len(self.heads) not in (1, len(base)):
            raise bad(f"{len(self.heads)} head counts given for {len(base)} pieces")
        out = []
        for i, p in enumerate(base):
            length = len(range(p.start, p.stop, p.step))
            if self.head_dim is not None:
                h = length // self.head_dim if length % self.head_dim == 0 else 0
            else:
                h = self.heads[i if len(self.heads) > 1 else 0]
            if h < 1 or length % h:
                per = f"head_dim={self.head_dim}" if self.head_dim is not None else f"{h} heads"
                raise bad(f"piece {i} of {length} rows does not divide into {per}")
            b = length // h
            for j in range(h):
                s = p.start + j * b * p.step
                out.append(slice(s, s + (b - 1) * p.step + 1, p.step))
        return out


def _bad_spec(text: str, where: str, msg: str) -> ValueError:
    return ValueError(f"{where}={text!r}: {msg}; allowed forms: {ALLOWED_FORMS}")


def _ints(text: str, key: str, value: str, where: str, minimum: int) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise _bad_spec(text, where, f"{key}={value!r} must be comma-separated integers") from None
    if any(v < minimum for v in out):
        raise _bad_spec(text, where, f"{key}={value!r}: every value must be >= {minimum}")
    return out


def parse_spec(text: str, where: str = "split_specs") -> SplitSpec:
    """One spec string -> SplitSpec; ValueError naming ``where`` and the allowed forms."""
    if not isinstance(text, str):
        raise _bad_spec(str(text), where, "a spec must be a string")
    fields: dict[str, str] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise _bad_spec(text, where, f"{part!r} is not key=value")
        if key not in _KEYS:
            raise _bad_spec(text, where, f"unknown key {key!r} (keys: {', '.join(_KEYS)})")
        if key in fields:
            raise _bad_spec(text, where, f"{key!r} given twice")
        fields[key] = value
    if "pattern" not in fields:
        raise _bad_spec(text, where, "missing pattern=<glob>")
    base = [k for k in ("sizes", "chunks", "interleave") if k in fields]
    if len(base) > 1:
        raise _bad_spec(text, where, f"{' and '.join(base)} cannot be combined")
    if "heads" in fields and "head_dim" in fields:
        raise _bad_spec(text, where, "heads and head_dim cannot be combined")
    if not base and "heads" not in fields and "head_dim" not in fields:
        raise _bad_spec(text, where, "nothing to split by: give sizes, chunks, interleave, heads or head_dim")
    kw: dict = {}
    if "sizes" in fields:
        kw["sizes"] = _ints(text, "sizes", fields["sizes"], where, 1)
        if len(kw["sizes"]) < 2:
            raise _bad_spec(text, where, "sizes needs at least two pieces")
    for key in ("chunks", "interleave"):
        if key in fields:
            values = _ints(text, key, fields[key], where, 2)
            if len(values) != 1:
                raise _bad_spec(text, where, f"{key}={fields[key]!r} must be one integer >= 2")
            kw[key] = values[0]
    if "heads" in fields:
        kw["heads"] = _ints(text, "heads", fields["heads"], where, 1)
        n_base = len(kw.get("sizes", ())) or kw.get("chunks") or kw.get("interleave") or 1
        if len(kw["heads"]) not in (1, n_base):
            raise _bad_spec(text, where, f"heads gives {len(kw['heads'])} counts for {n_base} pieces")
    if "head_dim" in fields:
        values = _ints(text, "head_dim", fields["head_dim"], where, 1)
        if len(values) != 1:
            raise _bad_spec(text, where, f"head_dim={fields['head_dim']!r} must be one integer >= 1")
        kw["head_dim"] = values[0]
    return SplitSpec(text=text, pattern=fields["pattern"], **kw)


def normalize_specs(value, where: str = "split_specs") -> tuple[str, ...]:
    """``split_specs`` as given (one string, specs joined by '|' or newlines; or a list/tuple
    of strings) -> tuple of spec strings, each validated."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        items = [t.strip() for t in re.split(r"[|\n]", value)]
        items = [t for t in items if t]
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        raise ValueError(f"{where}={value!r}: must be a string or a list of strings; allowed forms: {ALLOWED_FORMS}")
    for i, t in enumerate(items):
        parse_spec(t, f"{where}[{i}]")
    return tuple(items)


def _patterns(value: str) -> list[str]:
    return [p.strip() for p in value.split("|") if p.strip()]


def split_pieces(name: str, shape: tuple[int, ...], options) -> list[slice] | None:
    """The pieces (row slices of dim -2) parameter ``name`` of ``shape`` is cut into under
    ``options`` (a Dion3Config or a dict with split_specs / split_heads / split_heads_pattern),
    or None to keep it whole. The first matching spec wins; ``split_heads`` applies to the
    parameters matching ``split_heads_pattern`` that no spec matched."""
    get = options.get if isinstance(options, dict) else lambda k, d=None: getattr(options, k, d)
    rows = shape[-2]
    where = f" on parameter {name!r} of shape {tuple(shape)}"
    for i, text in enumerate(normalize_specs(get("split_specs", ()))):
        spec = parse_spec(text, f"split_specs[{i}]")
        if spec.matches(name):
            pieces = spec.pieces(rows, where)
            return pieces if len(pieces) > 1 else None
    heads = int(get("split_heads", 0) or 0)
    if heads > 0 and any(fnmatch.fnmatchcase(name, p) for p in _patterns(get("split_heads_pattern", ""))):
        spec = SplitSpec(text=f"split_heads={heads}", pattern="*", heads=(heads,))
        pieces = spec.pieces(rows, where)
        return pieces if len(pieces) > 1 else None
    return None


# ----------------------------------------------------------------- automatic specs
_QKV = re.compile(r"(^|\.)(wqkv|qkv|qkv_proj|Wqkv)\.weight$")
_GATE_UP = re.compile(r"(^|\.)(w13|w12|gate_up_proj|gate_up)(\.weight)?$")
_INTERLEAVED_GATE_UP = re.compile(r"(^|\.)mlp1_weight$")  # torchtitan gpt_oss: swiglu reads h[..., ::2], h[..., 1::2]
_N_HEADS = ("n_heads", "num_heads", "n_head", "num_attention_heads")
_N_KV = ("n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv_head")
_HEAD_DIM = ("head_dim",)
_INTER = (
    "hidden_dim",
    "moe_inter_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "inter_dim",
    "ffn_dim",
    "ffn_hidden_size",
)


def _attr(objs, names):
    for o in objs:
        for n in names:
            v = getattr(o, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _qkv_spec(rows: int, d_in: int, objs) -> str | None:
    heads = _attr(objs, _N_HEADS)
    if heads is None:
        return None
    kv = _attr(objs, _N_KV) or heads
    head_dim = _attr(objs, _HEAD_DIM) or (d_in // heads if d_in % heads == 0 else None)
    if head_dim is None:
        return None
    sizes = (heads * head_dim, kv * head_dim, kv * head_dim)
    return f"sizes={','.join(map(str, sizes))}" if sum(sizes) == rows else None


def auto_split_specs(model_or_named_params, model_args=None) -> list[str]:
    """Split specs for the fused weights of a model, for ``split_specs``.

    - torchtitan gpt_oss ``*.mlp1_weight`` (experts, (E, 2h, d)): gate/up interleaved rows ->
      ``interleave=2``.
    - fused QKV (``wqkv``/``qkv``/``qkv_proj``/``Wqkv`` ``.weight``): Q|K|V contiguous with GQA
      sizes, when the head counts are known (attributes n_heads / n_kv_heads / head_dim, or
      num_heads / num_key_value_heads, of the owning modules or of ``model_args``) and add up.
    - fused gate/up (``w13``/``w12``/``gate_up_proj``/``gate_up``): contiguous halves, only when
      an intermediate size in ``model_args`` (hidden_dim, moe_inter_dim, intermediate_size, ...)
      confirms dim -2 is 2 x that size.

    Layer indices become ``*`` so one spec covers every layer. Models with no fused weights
    (llama3, qwen3, llama4, deepseek_v3) get []. Per-head splitting is never automatic.
    """
    import torch.nn as nn

    from dion3_titan.optim.routing import clean_name

    if isinstance(model_or_named_params, nn.Module):
        modules = dict(model_or_named_params.named_modules())
        named = list(model_or_named_params.named_parameters())
    else:
        modules, named = {}, list(model_or_named_params)
    by_glob: dict[str, list[tuple[str, str]]] = {}
    for raw, p in named:
        if p.ndim not in (2, 3):
            continue
        name = clean_name(raw)
        rows, d_in = p.shape[-2], p.shape[-1]
        # the modules owning the parameter, innermost first, then the model args
        parts = raw.split(".")[:-1]
        owners = [modules[".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules]
        objs = [*owners, *([model_args] if model_args is not None else [])]
        spec = None
        if _INTERLEAVED_GATE_UP.search(name) and rows % 2 == 0:
            spec = "interleave=2"
        elif _QKV.search(name):
            spec = _qkv_spec(rows, d_in, objs)
            if spec is None:
                warnings.warn(
                    f"auto_split_specs: fused QKV {name!r} of shape {tuple(p.shape)} left whole: "
                    "head counts unknown or not adding up to its rows",
                    stacklevel=2,
                )
        elif _GATE_UP.search(name) and model_args is not None:
            inter = [getattr(model_args, a, None) for a in _INTER]
            if rows % 2 == 0 and rows // 2 in [v for v in inter if isinstance(v, int)]:
                spec = "chunks=2"
        if spec is None:
            continue
        glob = re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)
        by_glob.setdefault(glob, []).append((name, spec))
    out = []
    for glob, found in by_glob.items():
        if len({s for _, s in found}) == 1:
            out.append(f"pattern={glob};{found[0][1]}")
        else:  # layers disagree: one spec per parameter
            out.extend(f"pattern={_escape(n)};{s}" for n, s in found)
    return out


def _escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def with_auto_split_specs(options: dict, model, model_args=None) -> dict:
    """Dion3 keyword options for one model part: ``split_specs`` = the user's specs, then (when
    ``split_auto``, default True) ``auto_split_specs(model, model_args)``. User specs come
    first, so they override the automatic ones (the first match wins)."""
    opts = dict(options)
    specs = normalize_specs(opts.get("split_specs", ()))
    if opts.get("split_auto", True):
        specs = (*specs, *auto_split_specs(model, model_args))
    opts["split_specs"] = specs
    return opts
