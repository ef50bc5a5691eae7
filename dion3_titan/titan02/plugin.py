"""torchtitan 0.2 plugin: routes `[optimizer] name = "dion3" | "muon" | "normuon" | "prmuon"` to
our optimizers container (optimizers.py) and registers the offline datasets.

`register()` re-registers every importable built-in TrainSpec with a wrapped
`build_optimizers_fn` (our names build a `Dion3OptimizersContainer`, every other name goes to
the model's own torchtitan builder untouched) and a metrics builder that also logs our
optimizers' metrics (metrics.py). `fix_torchtitan()` patches two torchtitan 0.2.2 defects that
training meets.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torchtitan.components.optimizer as titan_optim
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols import train_spec as titan_specs
from torchtitan.tools.logging import logger

from dion3_titan.names import NAMES
from dion3_titan.titan02.metrics import wrap_metrics_builder
from dion3_titan.titan02.optimizers import Dion3OptimizersContainer, build_dion3_optimizers, with_titan_defaults


@contextlib.contextmanager
def _titan_builder_replaced(builder: Callable[..., OptimizersContainer]) -> Iterator[None]:
    """Makes torchtitan's composite builders (e.g. `build_optimizers_with_moe_load_balancing`,
    which calls the module-level `build_optimizers` and then registers the MoE expert-bias
    pre-step hook) build our container, so their hooks are torchtitan's own code."""
    saved = titan_optim.build_optimizers
    titan_optim.build_optimizers = builder
    try:
        yield
    finally:
        titan_optim.build_optimizers = saved


def wrap_builder(original: Callable[..., OptimizersContainer]) -> Callable[..., OptimizersContainer]:
    """`original`, except that our optimizer names build a Dion3OptimizersContainer."""

    def build(
        model_parts: list[nn.Module],
        optimizer_config: OptimizerConfig,
        parallel_dims: ParallelDims,
        ft_manager: FTManager | None = None,
    ) -> OptimizersContainer:
        if optimizer_config.name not in NAMES:
            return original(model_parts, with_titan_defaults(optimizer_config), parallel_dims, ft_manager)
        if original is titan_optim.build_optimizers:
            return build_dion3_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        with _titan_builder_replaced(build_dion3_optimizers):
            result = original(model_parts, optimizer_config, parallel_dims, ft_manager)
        if not isinstance(result, Dion3OptimizersContainer):
            raise NotImplementedError(
                f"{original.__module__}.{original.__name__} does not build its optimizers "
                f"through torchtitan's build_optimizers; name={optimizer_config.name!r} "
                "cannot be routed to Dion3 for this model"
            )
        return result

    build.__name__ = f"dion3_wrapped_{getattr(original, '__name__', 'builder')}"
    build.__wrapped__ = original  # type: ignore[attr-defined]
    return build


def _builtin_model_names() -> list[str]:
    from torchtitan.models import _supported_models

    return sorted(_supported_models)


def register() -> None:
    """Idempotent: wrap every importable built-in model's TrainSpec and register our datasets."""
    from dion3_titan.data.titan_dataset import register_datasets

    register_datasets()
    for name in _builtin_model_names():
        if name in titan_specs._extra_train_specs:
            continue  # already ours (or a user's own registration, which takes priority)
        try:
            spec = titan_specs.get_train_spec(name)
        except Exception as e:  # noqa: BLE001 - optional deps (e.g. flux needs extra packages)
            logger.debug(f"[dion3] model {name!r} not importable, not wrapped: {e}")
            continue
        wrapped = dataclasses.replace(
            spec,
            build_optimizers_fn=wrap_builder(spec.build_optimizers_fn),
            build_metrics_processor_fn=wrap_metrics_builder(spec.build_metrics_processor_fn),
        )
        titan_specs.register_train_spec(name, wrapped)


# ----------------------------------------------------------------- fixes to torchtitan 0.2.2
def fix_torchtitan() -> None:
    """Two torchtitan 0.2.2 defects that training meets, fixed by patching (idempotent;
    tests/test_upstream_symbols.py fails when a release renames what they patch)."""
    _initialize_router_bias()
    _normalize_pipeline_loss_before_backward()


def _initialize_router_bias() -> None:
    """torchtitan 0.2.2's MoE router initializes its gate weight but not the gate bias
    (`gate_bias = true`, as in gpt_oss), which keeps whatever memory it was given -- NaN at
    times, and then every loss is NaN. Zero it after the weight's own initialization."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    init = TokenChoiceTopKRouter.init_weights
    if getattr(init, "_dion3", False):
        return

    def init_weights(self, init_std: float) -> None:
        init(self, init_std)
        if self.gate.bias is not None:
            torch.nn.init.zeros_(self.gate.bias)

    init_weights._dion3 = True  # type: ignore[attr-defined]
    TokenChoiceTopKRouter.init_weights = init_weights  # type: ignore[method-assign]


def _normalize_pipeline_loss_before_backward() -> None:
    """torchtitan 0.2.2's pipeline schedule backpropagates each microbatch's summed loss and
    divides by the step's token count only the loss it logs (pytorch/torchtitan#2972), so with
    pipeline parallelism every gradient, and `grad_norm`, is `global_valid_tokens` times what it
    is without (and `max_norm` clips nearly every step). Divide inside the schedule's loss, as
    the non-PP path divides before backward; the logged loss stays the same."""
    from torchtitan.train import Trainer

    step = Trainer.forward_backward_step
    if getattr(step, "_dion3", False):
        return

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if not self.parallel_dims.pp_enabled:
            return step(self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        schedule = self.pp_schedule
        loss_sum = schedule._loss_fn

        def loss_per_token(pred, target, **kwargs):
            return loss_sum(pred, target, **kwargs) / global_valid_tokens

        schedule._loss_fn = loss_per_token
        try:
            loss = step(self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        finally:
            schedule._loss_fn = loss_sum
        # torchtitan divides the collected (now per-token) losses by the token count again
        return loss * global_valid_tokens if self.pp_has_last_stage else loss

    forward_backward_step._dion3 = True  # type: ignore[attr-defined]
    Trainer.forward_backward_step = forward_backward_step  # type: ignore[method-assign]
