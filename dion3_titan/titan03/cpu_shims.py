"""Let torchtitan 0.3 train on CPU (gloo) when no accelerator is present.

The shims that concern torch itself (the device module's helpers, FSDP's reductions on gloo,
integer histc, dense FlexAttention) are dion3_titan/cpu_shims.py's; the torchtitan modules
that bind the device at import and FlexAttention's entry point moved in 0.3. ``apply()`` is called by ``dion3_titan.train`` when no
accelerator exists.
"""

from dion3_titan import cpu_shims as shared

DEVICE_BINDERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
    "torchtitan.models.common.token_dispatcher",
)

_applied = False


def apply() -> None:
    """Install every shim. Idempotent; call before torchtitan's Trainer is built."""
    global _applied
    if _applied:
        return
    shared.device_cpu(DEVICE_BINDERS)
    shared.fsdp_sum_reductions()
    shared.histc_integers()
    _flex_attention_dense()
    _applied = True


def _flex_attention_dense() -> None:
    """FlexAttention (0.3's attention for every language model) refuses backward on CPU: for
    CPU inputs compute the same function densely (shared.dense_flex_attention)."""
    from torch.nn.attention.flex_attention import AuxOutput
    from torchtitan.models.common.attention import FlexAttention

    flex = FlexAttention._compiled_flex_attn
    if getattr(flex, "_dion3_shim", False):
        return

    def flex_attention_cpu(
        q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None, **kwargs
    ):
        if q.device.type != "cpu":
            return flex(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=scale,
                enable_gqa=enable_gqa,
                return_aux=return_aux,
                **kwargs,
            )
        if score_mod is not None:
            raise NotImplementedError("dion3_titan CPU shim: FlexAttention score_mod is not supported on CPU")
        out, lse = shared.dense_flex_attention(q, k, v, block_mask, scale, enable_gqa)
        return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)

    flex_attention_cpu._dion3_shim = True  # type: ignore[attr-defined]
    FlexAttention._compiled_flex_attn = flex_attention_cpu
