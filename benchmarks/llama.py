"""torchtitan llama3's parameter names and shapes (paper Table 4, and the model
scripts/bench_train.py trains) without a forward, built sharded or whole, and fresh synthetic
gradients written in place into its ``p.grad`` tensors; the llama3 arguments bench_train gives
torchtitan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from benchmarks.ranks import rank
from dion3_titan.data.build import DEFAULTS as CORPUS_DEFAULTS
from dion3_titan.dist.layout import to_local


@dataclass(frozen=True)
class ModelShape:
    """Llama layer shapes (paper Table 4)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# torchtitan llama3 arguments of the models scripts/bench_train.py trains (it adds the corpus's
# vocab_size). 1b: SwiGLU hidden int(1.5 * int(2 * 4 * 2048 / 3)) rounded up to 1024 = 8192, as
# in Llama 3.2 1B.
LLAMA3_ARGS: dict[str, dict[str, Any]] = {
    "1b": dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=1024),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64),
}


def llama3_shape(args: dict[str, Any], vocab: int) -> ModelShape:
    """The shapes torchtitan's llama3 builds from ``args``: its SwiGLU hidden is 2/3 of 4 x dim,
    times ``ffn_dim_multiplier`` when set, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * 4 * args["dim"] / 3)
    if args.get("ffn_dim_multiplier") is not None:
        hidden = int(args["ffn_dim_multiplier"] * hidden)
    step = args.get("multiple_of", 256)  # torchtitan's default
    return ModelShape(
        hidden=args["dim"],
        layers=args["n_layers"],
        heads=args["n_heads"],
        kv_heads=args["n_kv_heads"],
        mlp_hidden=-(-hidden // step) * step,
        vocab=vocab,
    )


# Paper Table 4, and (1b_train) the model scripts/bench_train.py trains on the large corpus.
MODELS: dict[str, ModelShape] = {
    "1b": ModelShape(hidden=1536, layers=24, heads=16, kv_heads=8, mlp_hidden=6656),
    "1b_train": llama3_shape(LLAMA3_ARGS["1b"], vocab=CORPUS_DEFAULTS["large"]["vocab_size"]),
    "3b": ModelShape(hidden=2304, layers=32, heads=18, kv_heads=6, mlp_hidden=9856),
    "4b": ModelShape(hidden=2560, layers=36, heads=32, kv_heads=8, mlp_hidden=10752),
    "7b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, mlp_hidden=11008),
    "14b": ModelShape(hidden=5120, layers=40, heads=40, kv_heads=8, mlp_hidden=14592),
    "tiny": ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, mlp_hidden=176, vocab=512),
}


class Attention(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.wq = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.wk = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.wv = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)


class FeedForward(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(s.hidden, s.mlp_hidden, bias=False)
        self.w2 = nn.Linear(s.mlp_hidden, s.hidden, bias=False)
        self.w3 = nn.Linear(s.hidden, s.mlp_hidden, bias=False)


class Block(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.attention = Attention(s)
        self.feed_forward = FeedForward(s)
        self.attention_norm = nn.RMSNorm(s.hidden)
        self.ffn_norm = nn.RMSNorm(s.hidden)


class LlamaParams(nn.Module):
    """torchtitan llama3's parameter names and shapes, without a forward."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)
        self.output = nn.Linear(s.hidden, s.vocab, bias=False)


def build_model(shape: ModelShape, device: torch.device, mesh, seed: int) -> LlamaParams:
    """Built on meta, sharded (FSDP2: each layer, then the root) when ``mesh`` is given, then
    materialized on ``device`` and filled with N(0, 0.02) (norm scales with 1)."""
    with torch.device("meta"):
        model = LlamaParams(shape)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 7919 * rank())
    with torch.no_grad():
        for p in model.parameters():
            local = to_local(p)
            if p.ndim == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=gen)
    return model


def count_params(shape: ModelShape) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaParams(shape).parameters())


def layer_matrices(shape: ModelShape) -> list[tuple[int, int]]:
    """(rows, cols) of one layer's matrices in parameter order: wq, wk, wv, wo, w1, w2, w3."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in Block(shape).parameters() if p.ndim == 2]


class GradFiller:
    """Fresh N(0, 1) gradients every step, written in place into fixed ``p.grad`` tensors."""

    def __init__(self, model: nn.Module, device: torch.device, seed: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.grad = torch.empty_like(p)
        self.locals = [to_local(p.grad) for p in self.params]
        self.seed = seed + 104729 * rank()
        self.gen = torch.Generator(device=device)
        self.reseed()
        self.fill()
        if any(not bool(g.ne(0).any()) for g in self.locals if g.numel()):
            raise RuntimeError("synthetic gradients came out all zero: the in-place fill did not land")

    def reseed(self) -> None:
        self.gen.manual_seed(self.seed)

    @torch.no_grad()
    def fill(self) -> None:
        for g in self.locals:
            g.normal_(generator=self.gen)
