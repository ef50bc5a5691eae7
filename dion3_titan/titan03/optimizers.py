"""torchtitan 0.3 optimizers container with Dion3, Muon, NorMuon and PRMuon param groups.

A config function writes::

    optimizer=Dion3Optimizers.Config(param_groups=[
        ParamGroupConfig(pattern=MATRICES, optimizer_name="Dion3",
                         optimizer_kwargs={"lr": 0.02, "fraction": 0.25, "flavor": "normuon"}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 3e-3, ...}),
    ])

torchtitan's own rules apply unchanged: patterns are searched in parameter names in order, the
first match wins, every trainable parameter must be matched, and groups of one optimizer name
share one optimizer instance per model part. Our names' ``optimizer_kwargs`` are the keys of
Dion3Config (and PRMuonConfig for "PRMuon"), validated when the config is built -- that is, while
torchtitan parses the config function and the command line, before any model exists.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.tools.logging import logger

from dion3_titan import clipping, compressed
from dion3_titan.dist.replicas import average_over_replicas
from dion3_titan.names import NAMES, PRMUON_KEYS, resolve_options
from dion3_titan.optim.cuda_graph import GraphedOptimizer, check_warmup, replaying
from dion3_titan.optim.dion3 import Dion3
from dion3_titan.optim.nonfinite import norm_ok
from dion3_titan.optimizer_metrics import OptimizerMetrics, combine
from dion3_titan.titan03.splits import split_specs_for

# optimizer_name -> our NAMES key
OPTIMIZER_NAMES = {"Dion3": "dion3", "Muon": "muon", "NorMuon": "normuon", "PRMuon": "prmuon"}
_SPELL = {v: k for k, v in OPTIMIZER_NAMES.items()}

# The block matrices of torchtitan 0.3's language models (llama3, qwen3, deepseek_v3, gpt_oss,
# qwen3_5 and kimi_k2_7's text layers): attention, gated-delta-net and MLP projections, shared
# and routed experts. Not matched, so left to the catch-all group: embeddings, lm_head, norms,
# biases, the router gate, convolutions, qwen3_5's per-head gate projections (in_proj_a/b) and
# the vision towers.
MATRICES = (
    r"^layers\.\d+\.(.+\.)?("
    r"((attention|attn)\.(.+\.)?(wqkv|wq|wk|wv|wo|wq_a|wq_b|wkv_a|wkv_b|in_proj_[qkvz]|out_proj))\.weight"
    r"|(feed_forward|shared_experts)\.w[123]\.weight"
    r"|inner_experts\.(w[123]_[A-Z]+|mlp[12]_weight_[A-Z]+)"
    r")$"
)


def check_param_group(pg: ParamGroupConfig, index: int) -> dict[str, Any]:
    """The validated options of one of our groups (ValueError naming the key otherwise)."""
    where = f"param_groups[{index}] (pattern={pg.pattern!r}, optimizer_name={pg.optimizer_name!r}) optimizer_kwargs:"
    return resolve_options(
        OPTIMIZER_NAMES[pg.optimizer_name],
        dict(pg.optimizer_kwargs),
        where=where,
        name_key="optimizer_name",
        spell=_SPELL,
    )


class Dion3Optimizers(OptimizersContainer):
    """torchtitan 0.3's OptimizersContainer, plus the names Dion3, Muon, NorMuon and PRMuon.

    Each of our groups becomes a param group of one Dion3 (or PeriodicRowwiseMuon) per optimizer
    name and model part, with its fused weights split into their pieces (splits.py). Groups of
    torchtitan's names are built by torchtitan's own factories. When torchtitan's clipping hands
    over the step's gradient norm (clipping.py), ours take their non-finite flag from it, and
    torchtitan's own fused Adam/AdamW/SGD skip with them (the norm covers their gradients too)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        cuda_graph: bool = False
        """Capture our optimizers' whole step in a CUDA graph after cuda_graph_warmup eager steps
        (works beside torchtitan's graphed forward+backward, training.disable_cuda_graphs)."""

        cuda_graph_warmup: int = 3

        optimizer_metrics: bool = False
        """Log optimizer metrics (time, communication, update RMS, selection) at metrics.log_freq;
        needs metrics=Dion3MetricsProcessor.Config(...)."""

        def __post_init__(self) -> None:
            for i, pg in enumerate(self.param_groups):
                if pg.optimizer_name in OPTIMIZER_NAMES:
                    check_param_group(pg, i)
            ours = sorted({pg.optimizer_name for pg in self.param_groups} & set(OPTIMIZER_NAMES))
            for name in ours if self.cuda_graph else ():
                if NAMES[OPTIMIZER_NAMES[name]].no_graph:
                    raise ValueError(
                        f"cuda_graph=True is not supported with optimizer_name={name!r}: "
                        f"{NAMES[OPTIMIZER_NAMES[name]].no_graph}; set cuda_graph=False"
                    )
            check_warmup(self.cuda_graph_warmup)

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.cuda_graph and not torch.cuda.is_available():
            raise ValueError("cuda_graph=True needs a CUDA GPU; set cuda_graph=False on this machine")
        impl_kwargs = self._build_impl_kwargs(config)
        options = {
            i: check_param_group(pg, i)
            for i, pg in enumerate(config.param_groups)
            if pg.optimizer_name in OPTIMIZER_NAMES
        }
        self.optimizers, self.model_parts = [], model_parts
        compressed_sync = any(opts.get("replicate_sync") == "compressed" for opts in options.values())
        if compressed_sync:
            compressed.prepare(model_parts)  # FSDP2 stops syncing gradients across replicas
        self._runners: list = []
        all_params: list[nn.Parameter] = []
        for part_idx, model in enumerate(model_parts):
            groups, patterns = self._build_param_groups(model, config.param_groups, impl_kwargs)
            # the options of each built group, in build order (groups are built in config order)
            ours_by_name: dict[str, list[dict[str, Any]]] = {}
            for i, pg in enumerate(config.param_groups):
                if i in options:
                    ours_by_name.setdefault(pg.optimizer_name, []).append(options[i])
            for name, built in groups.items():
                if name in OPTIMIZER_NAMES:
                    opt = self._build_ours(name, built, patterns[name], ours_by_name[name], model)
                    runner = GraphedOptimizer(opt, warmup_steps=config.cuda_graph_warmup) if config.cuda_graph else opt
                else:
                    opt = self._resolve_optimizer_factory(name)(
                        built, **config.optimizer_factory_kwargs_by_name.get(name, {})
                    )
                    runner = opt
                self.optimizers.append(opt)
                self._runners.append(runner)
                self._log_optimizer(opt, part_idx, patterns[name])
                all_params += [p for g in built for p in g["params"]]
        self._validate_params(all_params)
        # Under compressed sync FSDP2 no longer averages gradients across replicas; torchtitan's
        # own optimizers (AdamW on embeddings, norms, lm_head) get them averaged before they step.
        self._replica_averaged = [
            p
            for o in self.optimizers
            if not isinstance(o, Dion3) and compressed_sync
            for g in o.param_groups
            for p in g["params"]
        ]
        # torchtitan's clipping hands each step's gradient norm to use_gradient_norm
        clipping.install(self, all_params, replica_consistent=compressed_sync)
        # torchtitan's own optimizers that take torch's skip flag (fused ones) skip the steps ours do
        # when the flag comes from the gradient norm, which covers their gradients too
        self._skip_with_ours = [o for o in self._runners if not isinstance(o, Dion3) and _takes_found_inf(o)]
        self._norm: torch.Tensor | None = None  # the norm given for the next step
        if config.implementation == "fused_opt_states_bf16":
            self._register_bf16_optimizer_state_hook()
        self._post_init(all_params)
        self._metrics = (
            {id(r): OptimizerMetrics(r) for r in self._runners if isinstance(getattr(r, "optimizer", r), Dion3)}
            if config.optimizer_metrics
            else None
        )
        self.log_freq: int | None = None  # the trainer's logging period, set by Dion3MetricsProcessor
        self._step = 0

    @staticmethod
    def _build_ours(name: str, built: list[dict], patterns: list[str], options: list[dict], model: nn.Module):
        """One Dion3 / PeriodicRowwiseMuon over the groups torchtitan matched for ``name``."""
        engine = NAMES[OPTIMIZER_NAMES[name]]
        groups, ctor = [], {}
        for g, pattern, opts in zip(built, patterns, options, strict=True):
            flat = [n for n, p in zip(g["param_names"], g["params"]) if p.ndim not in (2, 3)]
            if flat:
                raise ValueError(
                    f"optimizer_name={name!r} pattern {pattern!r} matched {flat[:4]}{' ...' if len(flat) > 4 else ''}, "
                    "which are not matrices: only 2D matrices and 3D stacks of matrices can be orthogonalized; "
                    "narrow the pattern (e.g. dion3_titan.titan03.optimizers.MATRICES) and let a later "
                    "AdamW group take them"
                )
            opts = dict(opts)  # the same options serve every model part
            own = {k: opts.pop(k) for k in PRMUON_KEYS if k in opts}
            if own:
                if ctor and ctor != own:
                    raise ValueError(f"optimizer_name={name!r}: every group must give the same {sorted(own)}")
                ctor = own
            if engine.splits:
                opts = {**opts, "split_specs": split_specs_for(model, opts, g["param_names"])}
            groups.append(
                {
                    "params": g["params"],
                    "param_names": g["param_names"],
                    "names": g["param_names"],
                    "algorithm": "dion3",
                    **opts,
                }
            )
        return engine.cls(groups, **ctor)

    def step(self, closure=None) -> None:
        assert closure is None, "OptimizersContainer does not support closures"
        self._step += 1
        freq = self.log_freq
        measure = self._metrics is not None and freq is not None and (self._step == 1 or self._step % freq == 0)
        if self._metrics is not None and freq is None and self._step == 1:
            logger.warning(
                "[dion3] optimizer_metrics=True, but the job's metrics processor is not "
                "Dion3MetricsProcessor: set metrics=Dion3MetricsProcessor.Config(...) to log them"
            )
        if self._replica_averaged:
            average_over_replicas([p.grad for p in self._replica_averaged if p.grad is not None])
        found_inf = None if self._norm is None else 1.0 - norm_ok(self._norm)
        self._norm = None  # a norm serves one step
        for runner in self._runners:
            if self._metrics is not None and id(runner) in self._metrics:
                self._metrics[id(runner)].step(measure)
            elif found_inf is not None and runner in self._skip_with_ours:
                runner.found_inf = found_inf  # torch's fused kernels skip the step where it is 1
                runner.step()
                del runner.found_inf
            else:
                runner.step()

    @property
    def captured(self) -> bool:
        """Whether the step is being replayed now (after ``cuda_graph_warmup`` eager steps,
        until the graphs are released)."""
        return replaying(self._runners)

    def use_gradient_norm(self, norm: torch.Tensor) -> None:
        """This step's total gradient norm, from torchtitan's clipping (clipping.py): our
        optimizers take the step's non-finite flag from it, with no pass over the gradients."""
        for runner in self._runners:
            if isinstance(getattr(runner, "optimizer", runner), Dion3):
                runner.use_gradient_norm(norm)
        self._norm = norm

    def align_step(self, step: int) -> None:
        """The trainer's step, so that the logging steps stay aligned with it after a resume."""
        self._step = step

    def zero_grad(self, set_to_none: bool = True) -> None:
        for runner in self._runners:
            runner.zero_grad(set_to_none=set_to_none)

    def collect_metrics(self) -> dict[str, float]:
        """Metrics of the last measured step, summed (comm, time) or averaged over optimizers."""
        if not self._metrics:
            return {}
        return combine([m.collect() for m in self._metrics.values()])


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` passes its ``found_inf`` attribute to a fused kernel, which then
    skips the step where it is 1 (torch's gradient-scaling protocol): torch's Adam, AdamW and SGD
    with every group fused (torchtitan sets ``fused`` per group)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def dion3_param_groups(
    name: str = "Dion3",
    *,
    matrices: str = MATRICES,
    adamw: dict[str, Any],
    **options: Any,
) -> list[ParamGroupConfig]:
    """The usual two groups: ``matrices`` -> ``name`` with ``options``, everything else -> AdamW
    with ``adamw`` (lr, betas, eps, weight_decay)."""
    return [
        ParamGroupConfig(pattern=matrices, optimizer_name=name, optimizer_kwargs=dict(options)),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=dict(adamw)),
    ]
