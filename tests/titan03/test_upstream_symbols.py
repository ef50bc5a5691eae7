"""Every torch and torchtitan 0.3 symbol the 0.3 adapter (dion3_titan/titan03) patches or relies on
privately still exists, with the parameters our wrappers pass: a release that renames one fails
here, by name, instead of leaving a patch silently unapplied."""

import importlib
import inspect

import pytest

from dion3_titan.titan03 import cpu_shims


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


@pytest.mark.parametrize("module", cpu_shims.DEVICE_BINDERS)
def test_device_binders_bind_the_device(module: str) -> None:
    """cpu_shims.apply rebinds these modules' device globals (it skips a missing one)."""
    mod = importlib.import_module(module)
    assert hasattr(mod, "device_type") or hasattr(mod, "device_module")


def test_patched_symbols() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.nn.attention.flex_attention import AuxOutput
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.models.common.attention import FlexAttention

    # cpu_shims: dense FlexAttention returns (out, AuxOutput(lse=...))
    assert callable(FlexAttention._compiled_flex_attn)
    assert "lse" in inspect.signature(AuxOutput).parameters
    # train._torch_set_timeout: torchtitan 0.3 calls dist.set_timeout; older torch has the private one
    assert hasattr(dist, "set_timeout") or callable(distributed_c10d._set_pg_timeout)
    # metrics.Dion3MetricsProcessor overrides log and passes extra_metrics on
    assert {"step", "extra_metrics"} <= _params(MetricsProcessor.log)
    # optimizers.Dion3Optimizers builds through the base container's protected steps
    for name in ("_build_param_groups", "_validate_params", "_post_init", "_register_bf16_optimizer_state_hook"):
        assert callable(getattr(OptimizersContainer, name, None)), name
