"""NorMuon's per-row factors from the Newton-Schulz result's row sums of squares, in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dion3_titan.kernels.launch import launch, next_power_of_2
from dion3_titan.kernels.row_engine.operands import as_flag


@triton.jit
def _normuon_factors_kernel(
    rowsq_ptr,
    v_ptr,
    void_ptr,
    den_ptr,
    v_new_ptr,
    scale_ptr,
    K,
    stride_v0,
    stride_v1,
    beta2,
    one_minus_beta2,
    cols,
    eps,
    tiny,
    HAS_VOID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per matrix n: from its rows' sums of squares (n, K) and second moments,
    the new second moments, the rows' denominators sqrt(v_new) + eps and the matrix scale
    ||o|| / ||o_hat||, in the reference's order of operations (normuon_factors)."""
    n = tl.program_id(0)
    voided = False
    if HAS_VOID:
        voided = tl.load(void_ptr + n) != 0
    sum_o = tl.zeros([BLOCK], dtype=tl.float32)
    sum_hat = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < K
        rs = tl.load(rowsq_ptr + n * K + offs, mask=mask, other=0.0)
        if HAS_VOID:
            rs = tl.where(voided, 0.0, rs)
        v = tl.load(v_ptr + n * stride_v0 + offs * stride_v1, mask=mask, other=0.0).to(tl.float32)
        v_new = v * beta2 + (one_minus_beta2 * rs) / cols
        den = tl.sqrt_rn(v_new) + eps
        tl.store(den_ptr + n * K + offs, den, mask=mask)
        tl.store(v_new_ptr + n * K + offs, v_new, mask=mask)
        sum_o += rs
        sum_hat += tl.where(mask, rs / (den * den), 0.0)
    norm_hat = tl.maximum(tl.sqrt_rn(tl.sum(sum_hat, axis=0)), tiny)
    tl.store(scale_ptr + n, tl.sqrt_rn(tl.sum(sum_o, axis=0)) / norm_hat)


def normuon_factors(
    rowsq: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, cols: int, void: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NorMuon's factors from the rows' sums of squares ``rowsq`` (N, K) of the NS result and
    their second moments ``v`` (N, K): (denominators (N, K), matrix scales (N,), new second
    moments (N, K)), float32, in one launch. ``void`` (N,) bool: matrices taken as zero."""
    N, K = rowsq.shape
    if v.shape != (N, K) or not rowsq.is_contiguous():
        raise ValueError(f"normuon_factors: rowsq must be contiguous (N, K) and v {(N, K)}, got {tuple(v.shape)}")
    den = torch.empty_like(rowsq)
    v_new = torch.empty_like(rowsq)
    scale = torch.empty(N, dtype=torch.float32, device=rowsq.device)
    if N == 0:
        return den, scale, v_new
    block = min(1024, next_power_of_2(max(K, 1)))
    launch(
        _normuon_factors_kernel,
        (N,),
        rowsq,
        v,
        as_flag(void.contiguous()) if void is not None else rowsq,
        den,
        v_new,
        scale,
        K,
        *v.stride(),
        float(beta2),
        1.0 - beta2,
        float(cols),
        float(eps),
        torch.finfo(torch.float32).tiny,
        HAS_VOID=void is not None,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return den, scale, v_new
