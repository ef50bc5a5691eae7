"""Let torchtitan 0.2.2 train on CPU (gloo) when no accelerator is present: the shared shims
(dion3_titan/cpu_shims.py) on 0.2's modules, plus two that only 0.2 needs (expert parallelism's
token permutation, and FlexAttention's 0.2 entry point for gpt_oss). `apply()` is called by
train.py only when no accelerator exists.
"""

from typing import Any

import torch

from dion3_titan import cpu_shims as shared

# torchtitan modules that bind `device_type` / `device_module` at import time.
DEVICE_BINDERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
)


def _moe_permute_indices_cpu() -> None:
    """With expert parallelism, MoE token permutation builds its indices with a Triton
    kernel (`generate_permute_indices(use_cpu=False)`), and Triton has no CPU driver.
    torchtitan ships a CPU implementation behind `use_cpu=True`: select it for CPU tensors."""
    import torchtitan.models.moe.utils as moe_utils

    generate = moe_utils.generate_permute_indices
    if getattr(generate, "_dion3_shim", False):
        return

    def generate_on_cpu(tokens_per_expert_group: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tokens_per_expert_group.device.type == "cpu":
            kwargs["use_cpu"] = True
        return generate(tokens_per_expert_group, *args, **kwargs)

    generate_on_cpu._dion3_shim = True  # type: ignore[attr-defined]
    moe_utils.generate_permute_indices = generate_on_cpu


def _flex_attention_dense() -> None:
    """FlexAttention (gpt_oss's attention, with sliding windows and sinks) refuses
    backward on CPU. For CPU inputs, compute the same function densely (`dense_flex_attention`).
    Memory is O(seq_len²) per head, fine for CPU debug models."""
    from torchtitan.models.attention import FlexAttentionWrapper

    flex = FlexAttentionWrapper._compiled_flex_attn
    if getattr(flex, "_dion3_shim", False):
        return

    def flex_attention_cpu(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        block_mask: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        **kwargs: Any,
    ) -> Any:
        if q.device.type != "cpu":
            return flex(
                q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, **kwargs
            )
        if kwargs.get("score_mod") is not None:
            raise NotImplementedError("dion3_titan CPU shim: FlexAttention score_mod is not supported on CPU")
        out, lse = shared.dense_flex_attention(q, k, v, block_mask, scale, enable_gqa)
        return (out, lse) if return_lse else out

    flex_attention_cpu._dion3_shim = True  # type: ignore[attr-defined]
    FlexAttentionWrapper._compiled_flex_attn = flex_attention_cpu


_applied = False


def apply() -> None:
    """Install every shim. Idempotent; call before torchtitan's Trainer is built."""
    global _applied
    if _applied:
        return
    shared.device_cpu(DEVICE_BINDERS)
    shared.fsdp_sum_reductions()
    shared.histc_integers()
    _moe_permute_indices_cpu()
    _flex_attention_dense()
    _applied = True
