"""A textbook Dion3 (paper Alg. 4) on full matrices, written independently of the optimizer:
used as the single-process reference for distributed runs. Only the NS routine is shared
(tests/reference.py's textbook_ns)."""

import math

import torch

from tests.reference import ns_settings_fp32, textbook_ns


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Row counts of torch.chunk(n rows, parts) (FSDP2's sharding), padded with empty chunks."""
    sizes = [c.shape[0] for c in torch.empty(n).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))


def select(m: torch.Tensor, fraction: float, chunks: list[int] | None) -> torch.Tensor:
    """Rows of the largest l1 norm: of the whole matrix (chunks None: global scope) or the top
    ceil(f * largest chunk) of each chunk (local scope)."""
    norms = m.abs().sum(dim=1)
    if chunks is None:
        k = max(1, math.ceil(fraction * m.shape[0] - 1e-9))
        return norms.topk(k).indices.sort().values
    k = max(1, math.ceil(fraction * max(chunks) - 1e-9))
    picked, start = [], 0
    for size in chunks:
        if size:
            picked.append(start + norms[start : start + size].topk(min(k, size)).indices)
        start += size
    return torch.cat(picked).sort().values


def dion3_like_textbook(params, fraction: float, flavor: str, scope: str, **options):
    """The package's Dion3 with the settings the distributed tests compare to ``TextbookDion3``
    (lr 0.05, weight decay 0.1, float32 Newton-Schulz)."""
    from dion3_titan import Dion3

    settings = {"lr": 0.05, "ns_dtype": "float32", "weight_decay": 0.1, "backend": "torch", **options}
    return Dion3([{"params": list(params)}], fraction=fraction, flavor=flavor, selection_scope=scope, **settings)


class TextbookDion3:
    """Per full matrix W (rows = dim 0): M += G; S = top rows; O = polar(M[S]); optional
    NorMuon; W *= 1 - lr' wd; W[S] -= lr * scale * O; M[S] *= mu (lr' = lr / sqrt(f))."""

    def __init__(self, shapes, *, lr, fraction, flavor, momentum=0.95, beta2=0.95, wd=0.0, eps=1e-8, chunks=None):
        self.lr, self.f, self.flavor, self.mu, self.beta2, self.wd, self.eps = (
            lr,
            fraction,
            flavor,
            momentum,
            beta2,
            wd,
            eps,
        )
        self.chunks = chunks  # world size for local-scope selection, None for global
        self.m = [torch.zeros(s) for s in shapes]
        self.v = [torch.zeros(s[:-1]) for s in shapes]
        self.ns = ns_settings_fp32()

    def step(self, weights, grads):
        for w, g, m, v in zip(weights, grads, self.m, self.v):
            m += g
            w3, m3 = w.reshape(-1, *w.shape[-2:]), m.reshape(-1, *m.shape[-2:])
            v2 = v.reshape(-1, v.shape[-1])
            for b in range(m3.shape[0]):
                self._one(w3[b], m3[b], v2[b], batched=w.ndim == 3)

    def _one(self, w, m, v, batched=False):
        # FSDP shards a 3D stack along its batch of experts: each matrix stays whole
        chunks = None if self.chunks is None or batched else chunk_sizes(m.shape[0], self.chunks)
        rows = select(m, self.f, chunks)
        o = textbook_ns(m[rows], self.ns)
        if self.flavor == "normuon":
            v[rows] = self.beta2 * v[rows] + (1 - self.beta2) * o.square().mean(dim=1)
            oh = o / (v[rows].sqrt() + self.eps)[:, None]
            o = oh * (o.norm() / oh.norm())
        scale = math.sqrt(w.shape[0] / w.shape[1]) / math.sqrt(self.f)
        w.mul_(1 - self.lr / math.sqrt(self.f) * self.wd)  # Alg. 4 line 8 with the transferred lr
        w[rows] -= self.lr * scale * o
        m[rows] *= self.mu
