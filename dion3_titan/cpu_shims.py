"""CPU (gloo) shims both torchtitan adapters install when no accelerator is present: each fixes
one thing that breaks on a CPU-only machine. The torchtitan modules they touch differ by
generation, so each adapter's cpu_shims.py names its own and calls these (titan02/, titan03/).
"""

import importlib
import os
import platform
import resource
from types import SimpleNamespace
from typing import Any

import torch


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


def device_cpu(binders: tuple[str, ...]) -> None:
    """torchtitan falls back to device type "cuda" when torch reports no
    accelerator, which fails at the first `torch.cuda` call: use "cpu" and a device module
    that has the helpers torchtitan expects."""
    for name in binders:
        mod = importlib.import_module(name)
        for attr, value in (("device_type", "cpu"), ("device_module", _CpuDeviceModule())):
            if hasattr(mod, attr):
                setattr(mod, attr, value)


def fsdp_sum_reductions() -> None:
    """torchtitan sets FSDP's gradient divide factor (to 1.0, or the data-parallel
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
    """The MoE router counts tokens per expert with `torch.histc` on int64 expert
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
