"""Training-quality evidence on one GPU (issue 9): the same llama3-style model, data order,
initial weights and LR schedule for every optimizer, run one after another.

Runs (in this order; ``--runs`` picks a subset by name prefix):
  adamw_lr<η>        AdamW on every parameter, at each lr of ``--adamw-lrs``
then for each base lr of ``--matrix-lrs`` (suffix ``_lr<η>`` when there are several or the one
value is not the default, ``_mu<μ>`` for a non-default ``--momentum``):
  muon_torch         torch.optim.Muon (its own conventions: Nesterov, lr x sqrt(max(1, out/in)))
  muon_plain         the Muon baseline: every row, standard NS5 with Muon's quintic, lr x
                     sqrt(out/in) (our engine; tests/test_dion3_core.py holds it to a textbook Muon)
  dion3_f1_standard  Dion3 f=1, standard NS (Polar Express coefficients, our default)
  dion3_f1_gram      Dion3 f=1, Gram NS
  dion3_f0.25        Dion3 f=1/4, lr transfer η/√f (our default), NS algorithm "auto"
  normuon_plain, dion3n_*   the same four with the NorMuon flavor (the paper's main setting)
  prmuon             Periodic Row-wise Muon (dion3_titan.optim.prmuon)
  msdion3n_f<f>      microsoft/dion's Dion3 (NorMuon flavor, ``import dion``: the paper authors'
                     code) at f = ``--fraction``, lr η/√f (it has no lr transfer of its own), for
                     a side-by-side check of ours; only when ``--runs`` names it, skipped when
                     ``dion`` cannot be imported
Block matrices go to the orthogonalizing optimizer through ``routing.build_param_groups``;
embeddings, the output head and norms to AdamW (``--scalar-lr``, no weight decay; App. D.1).

Schedule (App. D.1): linear warmup, constant, linear cooldown over the last 25% of steps.
Validation loss on a fixed held-out set every ``--eval-every`` steps; forward+backward and
optimizer-step times per step (CUDA events around ``step()``, after a synchronize so only the
step is timed; perf_counter on CPU). After every run the whole JSON is rewritten to
``--out``/quality.json, so an interrupted command still returns the runs it finished.

The model is defined here (no torchtitan needed): RMSNorm, RoPE, SwiGLU, GQA, untied head,
torchtitan's parameter names (so routing sees tok_embeddings/output/norms as AdamW params).

    python scripts/quality_run.py --out /tmp/q                      # GPU preset
    python scripts/quality_run.py --tiny --data /tmp/tiny --out /tmp/q   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.output import write_json
from dion3_titan.optim.dion3 import Dion3
from dion3_titan.optim.routing import build_param_groups, is_matrix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MATRIX_LR = 0.02  # default base lr of the Muon-family runs; other values tag run names "_lr..."
MOMENTUM = 0.95  # default momentum of the Muon-family runs; other values tag run names "_mu..."


# ----------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    seq_len: int
    vocab_size: int = 0  # taken from the corpus' meta.json
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


# gpu: ~88M parameters (75.5M in block matrices); tiny: a few thousand, for CPU tests.
PRESETS = {
    "gpu": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, seq_len=1024),
    "tiny": ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, seq_len=16),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # normalize in fp32 under autocast, as torchtitan does
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, D) pairs (x[2i], x[2i+1]) in fp32 (llama's interleaved layout)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.n_kv, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim)
        # Repeat the KV heads explicitly: every SDPA backend (flash included) takes that.
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-3-style decoder; parameter names follow torchtitan's llama3."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's llama3 init: unit-normal embeddings, 0.02 for input projections,
        0.02 / sqrt(2 (layer + 1)) for the projections that write into the residual stream,
        dim^-1/2 for the head."""
        nn.init.normal_(self.tok_embeddings.weight)
        for i, layer in enumerate(self.layers):
            depth_std = 0.02 / math.sqrt(2 * (i + 1))
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=depth_std)
        std = self.cfg.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of ``targets`` given ``tokens``."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def count_params(model: nn.Module) -> dict[str, int]:
    named = list(model.named_parameters())
    return {
        "total": sum(p.numel() for _, p in named),
        "matrix": sum(p.numel() for n, p in named if is_matrix(n, p)),
        "embedding_and_head": model.tok_embeddings.weight.numel() + model.output.weight.numel(),
    }


# ----------------------------------------------------------------------------- data
def load_corpus(folder: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """train and validation token ids (int64 on ``device``: the whole corpus is ~45 MB) and
    the corpus' meta.json."""
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)

    def read(name: str) -> torch.Tensor:
        ids = np.fromfile(os.path.join(folder, name), dtype=np.uint16).astype(np.int64)
        return torch.from_numpy(ids).to(device)

    return read("train.bin"), read("val.bin"), meta


def batch_order(n_chunks: int, steps: int, batch: int, seed: int) -> np.ndarray:
    """(steps, batch) indices of non-overlapping training windows: a fresh seeded permutation
    per epoch, so every window is seen once before any repeats; identical for every run."""
    rng = np.random.default_rng(seed)
    need = steps * batch
    perms = [rng.permutation(n_chunks) for _ in range(-(-need // n_chunks))]
    return np.concatenate(perms)[:need].reshape(steps, batch)


def windows(ids: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for windows of seq_len + 1 tokens at ``starts``."""
    idx = starts[:, None] + torch.arange(seq_len + 1, device=ids.device)
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


class TrainBatches:
    def __init__(self, ids: torch.Tensor, seq_len: int, batch: int, steps: int, seed: int) -> None:
        self.ids, self.seq_len = ids, seq_len
        n_chunks = (ids.numel() - 1) // (seq_len + 1)
        self.n_chunks = n_chunks
        order = batch_order(n_chunks, steps, batch, seed) * (seq_len + 1)
        self.starts = torch.from_numpy(order).to(ids.device)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(self.ids, self.starts[step], self.seq_len)


def val_batches(
    ids: torch.Tensor, seq_len: int, batch: int, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: consecutive non-overlapping windows, up to ``max_tokens``."""
    n = min((ids.numel() - 1) // (seq_len + 1), max(1, max_tokens // seq_len))
    starts = torch.arange(n, device=ids.device) * (seq_len + 1)
    return [windows(ids, s, seq_len) for s in starts.split(batch)]


# ----------------------------------------------------------------------------- schedule
def lr_multiplier(step: int, steps: int, warmup: int, cooldown_frac: float, final: float) -> float:
    """Warmup-stable-cooldown (App. D.1): linear 0 -> 1 over ``warmup`` steps, 1, then linear
    1 -> ``final`` over the last ``cooldown_frac`` of the steps. ``step`` counts from 0."""
    cooldown_start = int(round(steps * (1.0 - cooldown_frac)))
    if step < warmup:
        return (step + 1) / warmup
    if step < cooldown_start:
        return 1.0
    progress = (step - cooldown_start + 1) / max(1, steps - cooldown_start)
    return 1.0 + (final - 1.0) * progress


# ----------------------------------------------------------------------------- optimizers
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


# ----------------------------------------------------------------------------- timing
class Timer:
    """Device time of a region: CUDA events on GPU (read once at the end of a run, so timing
    adds no sync of its own), perf_counter on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.pairs: list = []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, begin) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pairs.append((begin, e))
        else:
            self.pairs.append((begin, time.perf_counter()))

    def millis(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [round(a.elapsed_time(b), 4) for a, b in self.pairs]
        return [round((b - a) * 1e3, 4) for a, b in self.pairs]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- training
@torch.no_grad()
def evaluate(model: nn.Module, batches: list, autocast: Callable) -> float:
    total, count = 0.0, 0
    for x, y in batches:
        with autocast():
            loss = model(x, y)
        total += float(loss) * y.numel()
        count += y.numel()
    return total / count


def train_one(
    spec: RunSpec,
    model: nn.Module,
    init_state: dict,
    data: TrainBatches,
    val: list,
    args: argparse.Namespace,
    device: torch.device,
) -> dict:
    """One run from the shared initial weights; returns its curves and timings."""
    model.load_state_dict(init_state)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    opt = make_optimizer(spec, model, args, fused=device.type == "cuda")
    # floats: microsoft/dion keeps each group's lr in a persistent device tensor and copies
    # whatever is assigned into it, so holding that tensor here would compound the schedule
    base_lrs = [float(g["lr"]) for g in opt.param_groups]
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")  # noqa: E731
    fb_timer, opt_timer = Timer(device.type == "cuda"), Timer(device.type == "cuda")
    result: dict = {"spec": asdict(spec), "status": "ok", "val": [], "train": [], "host_opt_ms": []}
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step % args.eval_every == 0:
            result["val"].append([step, evaluate(model, val, autocast)])
        mult = lr_multiplier(step, args.steps, args.warmup, args.cooldown_frac, args.final_lr_frac)
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base * mult
        x, y = data(step)
        begin = fb_timer.start()
        with autocast():
            loss = model(x, y)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        fb_timer.stop(begin)
        loss_value = float(loss.detach())  # syncs: the step timer below then sees the optimizer alone
        result["train"].append(loss_value)
        if not math.isfinite(loss_value):
            result["status"] = f"diverged at step {step}"
            break
        host = time.perf_counter()
        begin = opt_timer.start()
        opt.step()
        opt_timer.stop(begin)
        result["host_opt_ms"].append(round((time.perf_counter() - host) * 1e3, 4))
        opt.zero_grad(set_to_none=True)
    else:
        result["val"].append([args.steps, evaluate(model, val, autocast)])
    sync(device)
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    result["fwd_bwd_ms"] = fb_timer.millis()
    result["opt_ms"] = opt_timer.millis()
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    result.update(summarize(result, args.steps))
    return result


def summarize(result: dict, steps: int) -> dict:
    """Headline numbers; step-time medians skip the first 5 steps (kernel compiles, allocs)."""

    def median(xs: list[float]) -> float | None:
        tail = xs[5:] if len(xs) > 10 else xs
        return round(float(np.median(tail)), 4) if tail else None

    done = result["status"] == "ok"
    return {
        "final_val": result["val"][-1][1] if done and result["val"] else None,
        "min_val": min(v for _, v in result["val"]) if result["val"] else None,
        "median_opt_ms": median(result["opt_ms"]),
        "median_host_opt_ms": median(result["host_opt_ms"]),
        "median_fwd_bwd_ms": median(result["fwd_bwd_ms"]),
        "total_opt_s": round(sum(result["opt_ms"]) / 1e3, 4),
        "steps_done": len(result["opt_ms"]),
        "steps": steps,
    }


def calibrate_steps(
    model: nn.Module, init_state: dict, data: TrainBatches, args: argparse.Namespace, n_runs: int, device: torch.device
) -> dict:
    """Time a few AdamW steps and shrink ``args.steps`` (to a multiple of 10) if all runs would
    not fit in ``--time-budget-s``. Orthogonalizing optimizers are assumed to cost
    ``--overhead`` times an AdamW step; evals are ignored (each is a few forward passes)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=device.type == "cuda")
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")  # noqa: E731
    times = []
    for step in range(args.calibration_steps + 3):
        sync(device)
        t = time.perf_counter()
        x, y = data(step)
        with autocast():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t)
    model.load_state_dict(init_state)
    del opt
    per_step = float(np.median(times[3:]))
    fit = int(args.time_budget_s / (n_runs * per_step * args.overhead)) // 10 * 10
    info = {"adamw_step_s": round(per_step, 5), "requested_steps": args.steps, "fit_steps": fit}
    if 0 < fit < args.steps:
        args.steps = max(fit, args.min_steps)
    info["steps"] = args.steps
    return info


# ----------------------------------------------------------------------------- output
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, few steps: CPU smoke run")
    p.add_argument("--data", help="corpus folder (default data/quality)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (gpu 500, tiny 4)")
    p.add_argument("--batch", type=int, help="sequences per step (gpu 16 x 1024 tokens, tiny 2 x 16)")
    p.add_argument("--warmup", type=int, help="warmup steps (default 5%% of steps, at least 1)")
    p.add_argument("--cooldown-frac", type=float, default=0.25)
    p.add_argument("--final-lr-frac", type=float, default=0.0, help="lr multiplier at the last step")
    p.add_argument("--eval-every", type=int, help="validation every N steps (gpu steps/10, tiny steps/2)")
    p.add_argument("--val-tokens", type=int, help="validation tokens, a cap (gpu 262144, tiny 64)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--runs", help="comma-separated name prefixes of the runs to do (default all)")
    p.add_argument("--adamw-lrs", type=lambda s: [float(v) for v in s.split(",")], default=[5e-4, 1e-3, 1.5e-3])
    p.add_argument("--adamw-weight-decay", type=float, default=0.1, help="AdamW runs, matrices only")
    p.add_argument(
        "--matrix-lrs",
        type=lambda s: [float(v) for v in s.split(",")],
        default=[MATRIX_LR],
        help="base lr(s) of the orthogonalized matrices; every Muon-family run per value "
        "(run names get an _lr suffix unless the only value is the default)",
    )
    p.add_argument("--matrix-weight-decay", type=float, default=0.01, help="App. D.1")
    p.add_argument("--momentum", type=float, default=MOMENTUM)
    p.add_argument("--fraction", type=float, default=0.25, help="f of the compressed Dion3 run")
    p.add_argument("--scalar-lr", type=float, default=3e-3, help="AdamW lr of embeddings/head/norms in non-AdamW runs")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip, 0 = off")
    p.add_argument("--cuda-graph", action="store_true", help="Dion3 runs: capture the step in a CUDA graph")
    p.add_argument("--time-budget-s", type=float, help="shrink --steps to fit (gpu 340 s; 0 = never)")
    p.add_argument("--overhead", type=float, default=1.35, help="calibration: step cost vs an AdamW step")
    p.add_argument("--calibration-steps", type=int, default=8)
    p.add_argument("--min-steps", type=int, default=100, help="calibration never goes below this")
    p.add_argument("--deadline-s", type=float, help="skip a run that would end after this (gpu 400 s)")
    a = p.parse_args(argv)
    gpu = not a.tiny
    a.preset = "tiny" if a.tiny else "gpu"
    a.data = a.data or os.path.join(REPO, "data", "quality")
    a.steps = a.steps or (500 if gpu else 4)
    a.batch = a.batch or (16 if gpu else 2)
    a.val_tokens = a.val_tokens or (1 << 18 if gpu else 64)
    a.evals = 10 if gpu else 2  # validation points besides step 0
    a.time_budget_s = (340.0 if gpu else 0.0) if a.time_budget_s is None else a.time_budget_s
    a.deadline_s = (400.0 if gpu else 0.0) if a.deadline_s is None else a.deadline_s
    if not a.out:
        p.error("--out is required when $OUT is not set")
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # tiny matrices: threads only add contention on a busy CPU
    try:
        return run_all(args, argv)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside pytest: leave it as found


def run_all(args: argparse.Namespace, argv: list[str] | None) -> dict:
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "quality.json")

    train_ids, val_ids, corpus = load_corpus(args.data, device)
    cfg = ModelConfig(**{**asdict(PRESETS[args.preset]), "vocab_size": corpus["vocab_size"]})
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    runs = default_runs(args)
    unavailable = {kind: missing(kind) for kind in ("prmuon", "ms_dion3")}
    calibration = None
    if args.time_budget_s > 0:
        probe = TrainBatches(train_ids, cfg.seq_len, args.batch, args.calibration_steps + 3, args.seed + 1)
        calibration = calibrate_steps(model, init_state, probe, args, len(runs), device)
    # Defaults that follow the (possibly calibrated) number of steps.
    args.warmup = args.warmup or max(1, args.steps // 20)
    args.eval_every = args.eval_every or max(1, args.steps // args.evals)
    data = TrainBatches(train_ids, cfg.seq_len, args.batch, args.steps, args.seed)
    val = val_batches(val_ids, cfg.seq_len, args.batch, args.val_tokens)

    tokens_per_step = args.batch * cfg.seq_len
    params = count_params(model)
    report: dict = {
        "meta": {
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "argv": sys.argv if argv is None else ["scripts/quality_run.py", *argv],
            "args": {k: v for k, v in vars(args).items()},
            "device": device_name(device),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "git_commit": git_commit(),
            "model": asdict(cfg),
            "params": params,
            "tokens_per_step": tokens_per_step,
            "train_tokens_per_run": tokens_per_step * args.steps,
            "epochs_per_run": round(tokens_per_step * args.steps / train_ids.numel(), 3),
            "val_tokens": sum(y.numel() for _, y in val),
            "flops_per_step": 6 * params["total"] * tokens_per_step,
            "corpus": {k: v for k, v in corpus.items() if k != "sha256"},
            "calibration": calibration,
            "schedule": "linear warmup, constant, linear cooldown over the last "
            f"{args.cooldown_frac:.0%} to x{args.final_lr_frac:g}",
        },
        "runs": {},
    }
    print(
        f"{device_name(device)}: {params['total'] / 1e6:.1f}M params ({params['matrix'] / 1e6:.1f}M matrix), "
        f"{args.steps} steps x {tokens_per_step} tokens, {len(runs)} runs; calibration {calibration}",
        flush=True,
    )
    longest = 0.0
    for spec in runs:
        elapsed = time.perf_counter() - started
        if unavailable.get(spec.kind):
            report["runs"][spec.name] = {"spec": asdict(spec), "status": f"skipped: {unavailable[spec.kind]}"}
        elif args.deadline_s > 0 and elapsed + longest > args.deadline_s:
            report["runs"][spec.name] = {"spec": asdict(spec), "status": f"skipped: deadline ({elapsed:.0f} s)"}
        else:
            try:
                result = train_one(spec, model, init_state, data, val, args, device)
            except Exception as e:  # one broken optimizer must not lose the other runs
                trace = traceback.format_exc()
                print(trace, file=sys.stderr, flush=True)
                result = {"spec": asdict(spec), "status": f"error: {type(e).__name__}: {e}", "traceback": trace[-4000:]}
            longest = max(longest, result.get("wall_s", 0.0))
            report["runs"][spec.name] = result
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = report["runs"][spec.name]
        print(
            f"{spec.name:20s} {r['status'][:60]:12s} final_val={r.get('final_val')} "
            f"opt_ms={r.get('median_opt_ms')} fwd_bwd_ms={r.get('median_fwd_bwd_ms')} wall_s={r.get('wall_s')}",
            flush=True,
        )
        report["meta"]["total_wall_s"] = round(time.perf_counter() - started, 2)
        write_json(out_path, report, indent=None)
    print(f"wrote {out_path} ({report['meta']['total_wall_s']} s)")
    return report


if __name__ == "__main__":
    main()
