"""Every torch and torchtitan 0.2 symbol the package patches or reads privately still exists, with
the parameters our wrappers pass: an upstream release that renames one fails here, by name,
instead of leaving a patch silently unapplied (the titan02 adapter's cpu_shims.py and plugin.py skip a patch whose
target looks applied, and the device shim skips a module without the global)."""

import importlib
import inspect

import pytest


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_torch_symbols() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.tensor import placement_types

    assert callable(dist.destroy_process_group)  # train.py: captured steps released first
    assert callable(torch.histc)  # cpu_shims.histc_integers
    # cpu_shims.fsdp_sum_reductions sets this flag on every FSDPParamGroup it creates
    assert "force_sum_reduction_for_comms" in inspect.getsource(FSDPParamGroup)
    # plugin._normalize_pipeline_loss_before_backward swaps the schedule's loss function
    assert "self._loss_fn" in inspect.getsource(_PipelineSchedule.__init__)
    # dist/layout.py: _StridedShard by type name, its local rows and its split factor
    strided = placement_types._StridedShard
    assert strided.__name__ == "_StridedShard"
    assert {"split_factor"} <= _params(strided.__init__) | set(getattr(strided, "__dataclass_fields__", {}))
    assert {"offset_mode"} <= _params(strided._local_shard_size_and_offset)
    assert hasattr(placement_types._StridedShardOffsetMode, "ALL")


@pytest.mark.parametrize(
    "module",
    [
        "torchtitan.tools.utils",
        "torchtitan.components.metrics",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.distributed.utils",
        "torchtitan.tools.profiling",
    ],
)
def test_device_binders_bind_the_device(module: str) -> None:
    """cpu_shims.device_cpu rebinds these modules' device globals (it skips a missing one)."""
    from dion3_titan.titan02 import cpu_shims

    assert module in cpu_shims.DEVICE_BINDERS
    mod = importlib.import_module(module)
    assert hasattr(mod, "device_type") or hasattr(mod, "device_module")


def test_torchtitan_symbols() -> None:
    import torchtitan.models.moe.utils as moe_utils
    from torchtitan.components import metrics
    from torchtitan.config import ConfigManager
    from torchtitan.models import _supported_models
    from torchtitan.models.attention import FlexAttentionWrapper
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter
    from torchtitan.protocols import train_spec
    from torchtitan.train import Trainer

    # cpu_shims: the CPU permutation, dense FlexAttention
    assert "use_cpu" in _params(moe_utils.generate_permute_indices)
    assert callable(FlexAttentionWrapper._compiled_flex_attn)
    # plugin.fix_torchtitan
    assert _params(TokenChoiceTopKRouter.init_weights) == {"self", "init_std"}
    assert {"input_dict", "labels", "global_valid_tokens"} <= _params(Trainer.forward_backward_step)
    # plugin.register and its metrics wrapper
    assert isinstance(train_spec._extra_train_specs, dict)
    assert "llama3" in _supported_models
    assert {"build_optimizers_fn", "build_metrics_processor_fn"} <= set(train_spec.TrainSpec.__dataclass_fields__)
    assert "extra_metrics" in _params(metrics.MetricsProcessor.log)
    assert callable(metrics.build_metrics_processor)
    # check_config: torchtitan's own TOML loading and custom-config merge
    assert callable(ConfigManager._maybe_add_custom_config)
    assert callable(ConfigManager._maybe_load_toml)


def test_torchtitan_optimizer_names() -> None:
    """check_config refuses an [optimizer] name that neither we nor torchtitan build: its list of
    torchtitan's names is the one build_optimizers holds."""
    import re

    from torchtitan.components import optimizer

    from dion3_titan.titan02.check_config import TITAN_OPTIMIZERS

    source = inspect.getsource(optimizer.build_optimizers)
    (table,) = re.findall(r"optimizer_classes = \{(.*?)\}", source, re.S)
    assert tuple(re.findall(r'"(\w+)":', table)) == TITAN_OPTIMIZERS
