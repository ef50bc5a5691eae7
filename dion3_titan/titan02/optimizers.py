"""torchtitan 0.2's optimizers container for `[optimizer] name = "dion3" | "muon" | "normuon" |
"prmuon"` (Dion3, and its subclass PeriodicRowwiseMuon).

`Dion3OptimizersContainer` subclasses torchtitan's `OptimizersContainer`, so the trainer's step
hooks (float8 post-step, MoE expert-bias pre-step), checkpointing (DCP, flattened optimizer
state) and LambdaLR work unchanged. `build_dion3_optimizers` has the signature of torchtitan's
`build_optimizers`; plugin.py routes our names to it.
"""

import dataclasses
from typing import Any

import torch
import torch.nn as nn
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from dion3_titan import clipping, compressed
from dion3_titan.names import DION3_KEYS, NAMES, PRMUON_KEYS, resolve_options
from dion3_titan.optim.config import Dion3Config, check_adamw
from dion3_titan.optim.cuda_graph import GraphedOptimizer, check_warmup, replaying
from dion3_titan.optim.routing import build_param_groups
from dion3_titan.optim.split import with_auto_split_specs
from dion3_titan.optimizer_metrics import OptimizerMetrics, combine
from dion3_titan.titan02 import metrics

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


def graph_warmup(cfg: OptimizerConfig) -> int | None:
    """``cuda_graph_warmup`` as set (None: unset), checked even with cuda_graph off, so a bad
    value is never ignored (ValueError naming the key)."""
    warmup = getattr(cfg, "cuda_graph_warmup", None)
    if warmup is not None:
        try:
            check_warmup(warmup)
        except ValueError as e:
            raise ValueError(f"[optimizer] {e}") from e
    return warmup


def adamw_options(cfg: OptimizerConfig) -> dict[str, Any]:
    """``build_param_groups``' AdamW keywords from the [optimizer] keys, checked (ValueError
    naming the key). adamw_lr and adamw_weight_decay unset: build_param_groups' defaults (the
    matrix lr; no weight decay)."""
    adamw: dict[str, Any] = {"adamw_betas": (cfg.beta1, cfg.beta2), "adamw_eps": cfg.eps}
    adamw.update({k: v for k in ("adamw_lr", "adamw_weight_decay") if (v := getattr(cfg, k)) is not None})
    values = {"beta1": cfg.beta1, "beta2": cfg.beta2, "eps": cfg.eps}
    values.update({k: adamw[f"adamw_{k}"] for k in ("lr", "weight_decay") if f"adamw_{k}" in adamw})
    check_adamw(values, "[optimizer] ", {"lr": "adamw_lr", "weight_decay": "adamw_weight_decay"})
    return adamw


class Dion3OptimizersContainer(OptimizersContainer):
    """One optimizer (Dion3 or a subclass) per model part (pipeline stage), each with the same
    two groups: matrices (algorithm "dion3") first, then AdamW for embeddings/output/norms/
    biases. The identical layout in every part is what torchtitan's LRSchedulersContainer
    assumes (it saves one LambdaLR state for all parts)."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig) -> None:
        optimizer_cls = NAMES[cfg.name].cls
        options = dion3_options(cfg)
        lr = options.pop("lr", Dion3Config.lr)
        adamw = adamw_options(cfg)
        self.model_parts = model_parts
        compressed_sync = options.get("replicate_sync") == "compressed"
        if compressed_sync:  # FSDP2 stops syncing across replicas
            compressed.prepare(model_parts)
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
        # torchtitan's clipping hands each step's gradient norm to use_gradient_norm
        clipping.install(self, all_params, replica_consistent=compressed_sync)
        self._metrics = (
            [OptimizerMetrics(r) for r in self._runners] if getattr(cfg, "optimizer_metrics", None) else None
        )
        self._step = 0
        metrics.LIVE.add(self)

    def _step_runners(self, cfg: OptimizerConfig) -> list:
        """What ``step`` calls per model part: the optimizer, or its captured step. ``cuda_graph``
        unset: captured wherever that works (a Dion3-engine optimizer on CUDA parameters with a
        selection the graph can replay), eager elsewhere, and one log line says which."""
        warmup = graph_warmup(cfg)
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
        measure = self._metrics is not None and metrics.should_log(self._step)
        for i, runner in enumerate(self._runners):
            if self._metrics is not None:
                self._metrics[i].step(measure)
            else:
                runner.step(*args, **kwargs)

    def use_gradient_norm(self, norm: torch.Tensor) -> None:
        """This step's total gradient norm, from torchtitan's clipping (clipping.py): every
        optimizer takes the step's non-finite flag from it, with no pass over the gradients."""
        for runner in self._runners:
            runner.use_gradient_norm(norm)

    @property
    def cuda_graph(self) -> bool:
        """Whether the step is replayed from CUDA graphs (the default's choice, or the config's)."""
        return any(isinstance(r, GraphedOptimizer) for r in self._runners)

    @property
    def captured(self) -> bool:
        """Whether the step is being replayed now (after ``cuda_graph_warmup`` eager steps,
        until the graphs are released)."""
        return replaying(self._runners)

    def align_step(self, step: int) -> None:
        """The trainer's step, so that the logging steps stay aligned with it after a resume."""
        self._step = step

    def collect_metrics(self) -> dict[str, float]:
        """Metrics of the last measured step, summed (comm, time) or averaged over model parts."""
        if not self._metrics:
            return {}
        return combine([m.collect() for m in self._metrics])

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
