"""Textbook references for the core tests, written independently of dion3_titan.optim.update.

Only the Newton-Schulz routine under test (``orthogonalize``) is shared with the optimizer, so a
mismatch points at the optimizer's bookkeeping (momentum, orientation, NorMuon, lr rules,
weight decay), not at the orthogonalization.
"""

from __future__ import annotations

import math

import torch

from dion3_titan.kernels.torch_ops import TorchOps
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.orthogonalize import NSSettings, orthogonalize


def ns_polynomial_via_svd(x: torch.Tensor, coefficients, eps: float = 1e-7) -> torch.Tensor:
    """The exact-arithmetic result of T Newton-Schulz steps: U p_T(...p_1(S)) V^T in float64,
    where X / (||X||_F + eps) = U S V^T. x: (B, n, m)."""
    x = x.double()
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    u, s, vh = torch.linalg.svd(x / (norm + eps), full_matrices=False)
    for a, b, c in coefficients:
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag_embed(s) @ vh


def ns_settings_fp32(**overrides) -> NSSettings:
    """The NS settings Dion3 uses for ns_dtype="float32" and otherwise default options."""
    cfg = Dion3Config(ns_dtype="float32", **overrides)
    return NSSettings(cfg.ns_algorithm, cfg.coefficients(), cfg.ns_restarts, torch.float32, cfg.ns_eps)


def textbook_ns(m: torch.Tensor, settings: NSSettings) -> torch.Tensor:
    """polar(M) of one 2D matrix with the shared NS routine (one matrix at a time)."""
    return orthogonalize(m[None], settings, TorchOps())[0].float()


def lr_multiplier(d_out: int, d_in: int, rule: str) -> float:
    if rule == "spectral":
        return math.sqrt(d_out / d_in)
    if rule == "rms":
        return 0.2 * math.sqrt(max(d_out, d_in))
    assert rule == "none"
    return 1.0


class TextbookMuon:
    """Muon / NorMuon as usually written (f = 1), one matrix at a time; a 3D (E, n, m) parameter
    is E independent matrices.

    M <- mu M + G;  O <- NS(M);  NorMuon: per row i of W (output neuron, whatever the shape),
    v_i <- b2 v_i + (1 - b2) mean_j O_ij^2, O_hat = O / (sqrt(v) + eps),
    O_hat *= ||O||_F / ||O_hat||_F;  W <- W (1 - lr wd) - lr * scale * O_hat.
    """

    def __init__(self, params, *, lr, momentum, weight_decay, lr_rule, flavor, beta2=0.95, eps=1e-8):
        self.params = list(params)
        self.lr, self.mu, self.wd, self.rule, self.flavor = lr, momentum, weight_decay, lr_rule, flavor
        self.beta2, self.eps = beta2, eps
        self.settings = ns_settings_fp32()
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = []
        for p in self.params:
            d_out, d_in = p.shape[-2:]
            stack = p.shape[0] if p.ndim == 3 else 1
            self.v.append(torch.zeros(stack, d_out))

    @torch.no_grad()
    def step(self, grads) -> None:
        for i, (p, g) in enumerate(zip(self.params, grads)):
            self.m[i] = self.mu * self.m[i] + g
            d_out, d_in = p.shape[-2:]
            scale = lr_multiplier(d_out, d_in, self.rule)
            mats_m = self.m[i] if p.ndim == 3 else self.m[i][None]
            new_w = []
            for e in range(mats_m.shape[0]):
                o = textbook_ns(mats_m[e], self.settings)
                if self.flavor == "normuon":
                    self.v[i][e] = self.beta2 * self.v[i][e] + (1 - self.beta2) * (o * o).mean(dim=1)
                    hat = o / (self.v[i][e].sqrt() + self.eps)[:, None]
                    o = hat * (o.norm() / hat.norm())
                w = p[e] if p.ndim == 3 else p
                new_w.append(w * (1 - self.lr * self.wd) - self.lr * scale * o)
            p.copy_(torch.stack(new_w) if p.ndim == 3 else new_w[0])
