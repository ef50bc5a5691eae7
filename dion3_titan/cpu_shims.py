"""Let torchtitan 0.2.2 train on CPU (gloo) when no accelerator is present (0.3: titan03/cpu_shims.py,
which reuses the generation-independent shims here).

torchtitan assumes a CUDA-like device. Each shim below fixes one thing that breaks on a
CPU-only machine (the sixth only matters for FlexAttention models such as gpt_oss);
`apply()` is called by `dion3_titan.train` only when no accelerator exists.
"""

import importlib
import os
import platform
import resource
from types import SimpleNamespace
from typing import Any

import torch

# torchtitan modules that bind `device_type` / `device_module` at import time.
DEVICE_BINDERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
)


class _CpuDeviceModule:
    """`torch.cpu` plus the `torch.cuda`-style helpers torchtitan calls on its device module
    (the memory monitor's name, capacity and peak statistics)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(total_memory=total)

    @staticmethod
    def current_device() -> int:
        # torch.cpu.current_device() returns "cpu"; torchtitan passes this value to
        # barrier(device_ids=[...]), which takes ints (and gloo ignores them).
        return 0

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        # No caching allocator on CPU: report the process's peak resident set instead.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def device_cpu(binders: tuple[str, ...] = DEVICE_BINDERS) -> None:
    """Shims 1+2. torchtitan falls back to device type "cuda" when torch reports no
    accelerator, which fails at the first `torch.cuda` call: use "cpu" and a device module
    that has the helpers torchtitan expects."""
    for name in binders:
        mod = importlib.import_module(name)
        for attr, value in (("device_type", "cpu"), ("device_module", _CpuDeviceModule())):
            if hasattr(mod, attr):
                setattr(mod, attr, value)


def fsdp_sum_reductions() -> None:
    """Shim 3. torchtitan sets FSDP's gradient divide factor (to 1.0, or the data-parallel
    size), which FSDP2 implements as ReduceOp.PREMUL_SUM or AVG; gloo has neither. FSDP's own
    switch `force_sum_reduction_for_comms` reduces with SUM and scales separately (same
    result): turn it on for every FSDP parameter group as it is created."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    init = FSDPParamGroup.__init__
    if getattr(init, "_dion3_shim", False):
        return

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.force_sum_reduction_for_comms = True

    __init__._dion3_shim = True  # type: ignore[attr-defined]
    FSDPParamGroup.__init__ = __init__  # type: ignore[method-assign]


def histc_integers() -> None:
    """Shim 4. The MoE router counts tokens per expert with `torch.histc` on int64 expert
    indices; CUDA supports integer histc, CPU raises "histogram_cpu not implemented for
    'Long'". For integer CPU inputs only (which would otherwise raise), count in float32
    (exact below 2**24 per bin) and return the input's dtype, as CUDA does."""
    histc = torch.histc
    if getattr(histc, "_dion3_shim", False):
        return

    def histc_cpu_ints(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.device.type == "cpu" and not input.is_floating_point() and "out" not in kwargs:
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    histc_cpu_ints._dion3_shim = True  # type: ignore[attr-defined]
    torch.histc = histc_cpu_ints


def _moe_permute_indices_cpu() -> None:
    """Shim 5. With expert parallelism, MoE token permutation builds its indices with a Triton
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


def dense_flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float | None, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's function computed densely: the block mask's `mask_mod` evaluated on the
    full (query, key) grid, softmax in (at least) float32; returns (output, log-sum-exp)."""
    from torch.nn.attention.flex_attention import create_mask

    batch, heads, q_len, head_dim = q.shape
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)  # at least float32 softmax
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * (head_dim**-0.5 if scale is None else scale)
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, batch, heads, q_len, k.shape[-2], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows with no visible key: FlexAttention returns zeros (and lse = -inf).
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(acc).min))
    return (probs @ v.to(acc)).to(q.dtype), lse


def _flex_attention_dense() -> None:
    """Shim 6. FlexAttention (gpt_oss's attention, with sliding windows and sinks) refuses
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
        out, lse = dense_flex_attention(q, k, v, block_mask, scale, enable_gqa)
        return (out, lse) if return_lse else out

    flex_attention_cpu._dion3_shim = True  # type: ignore[attr-defined]
    FlexAttentionWrapper._compiled_flex_attn = flex_attention_cpu


_applied = False


def apply() -> None:
    """Install every shim. Idempotent; call before torchtitan's Trainer is built."""
    global _applied
    if _applied:
        return
    device_cpu()
    fsdp_sum_reductions()
    histc_integers()
    _moe_permute_indices_cpu()
    _flex_attention_dense()
    _applied = True
