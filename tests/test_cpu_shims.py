"""The CPU shim that lets gpt_oss-style models (FlexAttention) train on CPU computes the same
function as FlexAttention, and its gradients are those of plain masked attention."""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dion3_titan.titan02 import cpu_shims


def _sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 12)


def test_dense_flex_attention_matches_flex_and_masked_sdpa() -> None:
    from torchtitan.models.attention import FlexAttentionWrapper

    cpu_shims._flex_attention_dense()
    dense = FlexAttentionWrapper._compiled_flex_attn
    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, length, dim = 2, 6, 2, 40, 16
    q, k, v = (
        torch.randn(batch, h, length, dim, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)
    )
    mask = create_block_mask(_sliding_window, batch, None, length, length, device="cpu")

    with torch.no_grad():  # FlexAttention itself runs on CPU without autograd
        ref_out, ref_lse = flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True, return_lse=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dense(*leaves, block_mask=mask, scale=0.3, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), rtol=1e-6, atol=1e-6)

    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * weights).sum().backward()
    sdpa_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grid = torch.arange(length)
    allowed = _sliding_window(None, None, grid[:, None], grid[None, :])
    sdpa = F.scaled_dot_product_attention(*sdpa_leaves, attn_mask=allowed, scale=0.3, enable_gqa=True)
    (sdpa * weights).sum().backward()
    for mine, ref in zip(leaves, sdpa_leaves):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-6, atol=1e-8)
