"""torchtitan plugin: routes `[optimizer] name = "dion3" | "muon" | "normuon" | "prmuon"` to our
optimizers (Dion3, and its subclass PeriodicRowwiseMuon).

`register()` re-registers every importable built-in TrainSpec with a wrapped
`build_optimizers_fn`: our names build a `Dion3OptimizersContainer`, every other name goes to
the model's own torchtitan builder untouched. The container subclasses torchtitan's
`OptimizersContainer`, so the trainer's step hooks (float8 post-step, MoE expert-bias pre-step),
checkpointing (DCP, flattened optimizer state) and LambdaLR work unchanged.
"""

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torchtitan.components.optimizer as titan_optim
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols import train_spec as titan_specs
from torchtitan.tools.logging import logger

from dion3_titan.metrics import OptimizerMetrics
from dion3_titan.names import DION3_KEYS, NAMES, PRMUON_KEYS, resolve_options
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.cuda_graph import GraphedOptimizer, check_warmup
from dion3_titan.optim.routing import build_param_groups
from dion3_titan.optim.split import with_auto_split_specs

EXTENSION = "dion3_titan.job_config"
# torchtitan's defaults of the keys our extension redeclares as unset (None): AdamW's values
_TITAN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimizerConfig) if f.name in ("lr", "weight_decay")}


def has_extension(cfg: OptimizerConfig) -> bool:
    """True when the job config was built with our `[optimizer]` keys (custom_config_module)."""
    return hasattr(cfg, "adamw_weight_decay")


def with_titan_defaults(cfg: OptimizerConfig) -> OptimizerConfig:
    """`cfg` with torchtitan's own defaults in place of unset `lr`/`weight_decay`: what
    torchtitan's builders get for names that are not ours."""
    unset = {k: v for k, v in _TITAN_DEFAULTS.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **unset) if unset else cfg


def dion3_options(cfg: OptimizerConfig) -> dict[str, Any]:
    """Keyword arguments for the optimizer `cfg.name` names, validated (ValueError naming the
    key and its allowed values). Only keys the user set are passed (unset keys are None), so
    the optimizer's own defaults apply to the rest, `lr` and `weight_decay` included."""
    if not has_extension(cfg):
        raise ValueError(
            f"[optimizer] name={cfg.name!r} needs [job] custom_config_module = {EXTENSION!r} (or a "
            "JobConfig that extends it): without it lr and weight_decay are torchtitan's AdamW "
            "defaults and the Dion3 keys do not exist"
        )
    opts: dict[str, Any] = {}
    for key in DION3_KEYS + PRMUON_KEYS:
        value = getattr(cfg, key, None)
        if value is not None:
            opts[key] = value
    return resolve_options(cfg.name, opts)


_LIVE: "weakref.WeakSet[Dion3OptimizersContainer]" = weakref.WeakSet()
_LOG_FREQ = [10]  # torchtitan's metrics.log_freq, read when its metrics processor is built


def _should_log(step: int) -> bool:
    """torchtitan's MetricsProcessor.should_log rule."""
    return step == 1 or step % _LOG_FREQ[0] == 0


def wrap_metrics_builder(original: Callable | None) -> Callable:
    """torchtitan's metrics processor whose ``log`` also reports our optimizers' metrics."""
    from torchtitan.components.metrics import build_metrics_processor

    original = original or build_metrics_processor

    def build(job_config, *args, **kwargs):
        processor = original(job_config, *args, **kwargs)
        _LOG_FREQ[0] = job_config.metrics.log_freq
        log = processor.log

        def log_with_optimizer(step, *a, extra_metrics=None, **k):
            extra = dict(extra_metrics or {})
            ours: dict[str, float] = {}
            for container in list(_LIVE):
                ours.update(container.collect_metrics())
                container.align_step(step)
            if ours:  # the console line; TensorBoard/W&B get them through extra_metrics
                logger.info(
                    f"[dion3] step {step:2} " + "  ".join(f"{k[len('optimizer/') :]}={v:.4g}" for k, v in ours.items())
                )
            return log(step, *a, extra_metrics={**extra, **ours}, **k)

        processor.log = log_with_optimizer
        return processor

    return build


class Dion3OptimizersContainer(OptimizersContainer):
    """One optimizer (Dion3 or a subclass) per model part (pipeline stage), each with the same
    two groups: matrices (algorithm "dion3") first, then AdamW for embeddings/output/norms/
    biases. The identical layout in every part is what torchtitan's LRSchedulersContainer
    assumes (it saves one LambdaLR state for all parts)."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig) -> None:
        optimizer_cls = NAMES[cfg.name].cls
        options = dion3_options(cfg)
        lr = options.pop("lr", Dion3Config.lr)
        adamw = {"adamw_betas": (cfg.beta1, cfg.beta2), "adamw_eps": cfg.eps}
        # unset: build_param_groups' defaults (the matrix lr; no weight decay)
        adamw.update({k: v for k in ("adamw_lr", "adamw_weight_decay") if (v := getattr(cfg, k)) is not None})
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for model in model_parts:
            groups = build_param_groups(model.named_parameters(), **adamw)
            # fused weights of built-in models (gpt_oss mlp1) split into their pieces
            part_options = with_auto_split_specs(options, model) if NAMES[cfg.name].splits else options
            self.optimizers.append(optimizer_cls(groups, lr=lr, **part_options))
            all_params += [p for g in groups for p in g["params"]]
        self._validate_length(len(model_parts))
        # Optimizer.__init__ on the container (hooks, defaults) as torchtitan's own does.
        self._post_init(all_params, {"lr": lr, **options})
        self._log_routing(cfg.name, optimizer_cls.__name__)
        self._runners = self._step_runners(cfg)
        self._metrics = (
            [OptimizerMetrics(r) for r in self._runners] if getattr(cfg, "optimizer_metrics", None) else None
        )
        self._step = 0
        _LIVE.add(self)

    def _step_runners(self, cfg: OptimizerConfig) -> list:
        """What ``step`` calls per model part: the optimizer, or its captured step. ``cuda_graph``
        unset: captured wherever that works (a Dion3-engine optimizer on CUDA parameters with a
        selection the graph can replay), eager elsewhere, and one log line says which."""
        warmup = getattr(cfg, "cuda_graph_warmup", None)
        if warmup is not None:  # checked even with cuda_graph off: a bad value is never ignored
            try:
                check_warmup(warmup)
            except ValueError as e:
                raise ValueError(f"[optimizer] {e}") from e
        requested = getattr(cfg, "cuda_graph", None)
        if requested is None:
            why = self._graph_blocker(cfg)
            logger.info(f"[optimizer] cuda_graph {'off: ' + why if why else 'on'} (default; set cuda_graph to choose)")
            if why:
                return list(self.optimizers)
        elif not requested:
            return list(self.optimizers)
        graph_options = {} if warmup is None else {"warmup_steps": warmup}
        if NAMES[cfg.name].no_graph:
            raise ValueError(
                f"[optimizer] cuda_graph=true is not supported with name={cfg.name!r}: "
                f"{NAMES[cfg.name].no_graph}; set cuda_graph=false"
            )
        if not torch.cuda.is_available():
            raise ValueError("[optimizer] cuda_graph=true needs a CUDA GPU; set cuda_graph=false on this machine")
        return [GraphedOptimizer(o, **graph_options) for o in self.optimizers]

    def _graph_blocker(self, cfg: OptimizerConfig) -> str:
        """Why the step cannot be captured by default ("" when it can)."""
        if NAMES[cfg.name].no_graph:
            return f"name={cfg.name!r}: {NAMES[cfg.name].no_graph}"
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda for p in params):
            return "parameters not on a CUDA device"
        if any(g.get("selection") == "random" for o in self.optimizers for g in o.param_groups):
            return "selection='random' reseeds every step"
        return ""

    def step(self, *args, **kwargs) -> None:
        self._step += 1
        measure = self._metrics is not None and _should_log(self._step)
        for i, runner in enumerate(self._runners):
            if self._metrics is not None:
                self._metrics[i].step(measure)
            else:
                runner.step(*args, **kwargs)

    @property
    def cuda_graph(self) -> bool:
        """Whether the step is replayed from CUDA graphs (the default's choice, or the config's)."""
        return any(isinstance(r, GraphedOptimizer) for r in self._runners)

    def align_step(self, step: int) -> None:
        """The trainer's step, so that the logging steps stay aligned with it after a resume."""
        self._step = step

    def collect_metrics(self) -> dict[str, float]:
        """Metrics of the last measured step, summed (comm, time) or averaged over model parts."""
        if not self._metrics:
            return {}
        parts = [m.collect() for m in self._metrics]
        out: dict[str, float] = {}
        for part in parts:
            for key, value in part.items():
                out[key] = out.get(key, 0.0) + value
        averaged = ("update_rms", "selection", "peak_mem")
        for key in out:
            if any(a in key for a in averaged):
                out[key] /= len(parts)
        return out

    def _log_routing(self, name: str, cls_name: str) -> None:
        counts = {"dion3": [0, 0], "adamw": [0, 0]}
        for opt in self.optimizers:
            for g in opt.param_groups:
                counts[g["algorithm"]][0] += len(g["params"])
                counts[g["algorithm"]][1] += sum(p.numel() for p in g["params"])
        d, a = counts["dion3"], counts["adamw"]
        logger.info(
            f"[dion3] optimizer {name!r}: {d[0]} matrices ({d[1]:,} elements) -> {cls_name}, "
            f"{a[0]} tensors ({a[1]:,} elements) -> AdamW"
        )


def build_dion3_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims,
    ft_manager: FTManager | None = None,
) -> Dion3OptimizersContainer:
    """Same signature as torchtitan's `build_optimizers`."""
    if optimizer_config.early_step_in_backward:
        raise NotImplementedError(
            "[optimizer] early_step_in_backward=true is not supported with name="
            f"{optimizer_config.name!r}: Dion3 orthogonalizes each shape group of matrices "
            "together after the whole backward pass, so it cannot step one parameter at a "
            "time inside backward; set early_step_in_backward=false"
        )
    if ft_manager is not None and ft_manager.enabled:
        raise NotImplementedError(
            f"[optimizer] name={optimizer_config.name!r} does not support torchft fault "
            "tolerance ([fault_tolerance] enable=true): torchft's optimizer wrapper assumes "
            "per-replica optimizer state, while Dion3 exchanges rows across ranks every step"
        )
    return Dion3OptimizersContainer(model_parts, optimizer_config)


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
