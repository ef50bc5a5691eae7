"""What each configuration of scripts/bench_step.py steps: the optimizer built on the model's
parameters (ours, torch's or microsoft/dion's, eager or under a CUDA graph) and the
Newton-Schulz FLOPs its step runs on this rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from benchmarks.ranks import rank, world_size
from benchmarks.step_configs import ADAMW_LR, GRAPH_WARMUP, MATRIX_LR, BenchConfig, anchor_module
from dion3_titan import Dion3
from dion3_titan.dist.layout import to_local
from dion3_titan.kernels.flops import ns_flops
from dion3_titan.optim.routing import build_param_groups


def dion3_rank_flops(opt: Dion3) -> float:
    """NS FLOPs this rank runs per step, read from the optimizer's plan: each shape group's
    owned batch at its padded (rows, cols), Gram or standard as the engine resolves it, and
    symmetric products at half cost when the chosen backend is not plain torch."""
    from dion3_titan.dist.comm import ShardedExchange
    from dion3_titan.kernels.dispatch import select_backend

    total = 0.0
    for sg in opt.shape_groups:
        cfg = opt.configs[sg.group_index]
        ex = sg.exchange
        if isinstance(ex, ShardedExchange):
            count, rows, cols = ex.n_own, ex.n_rb * ex.k, ex.n_cb * ex.cols
        elif hasattr(ex, "mine"):  # replicated: this rank's share
            count, rows, cols = len(ex.mine), sg.k, sg.cols
        else:
            count, rows, cols = sg.batch, sg.k, sg.cols
        if count == 0 or rows == 0:
            continue
        device = to_local(sg.members[0].param).device
        try:
            backend = select_backend(cfg.backend, (count, rows, cols), cfg.compute_dtype, device).name
        except Exception:  # a backend that cannot load here: count as the config asks
            backend = cfg.backend
        total += count * ns_flops(rows, cols, cfg.ns_algorithm, cfg.ns_steps, cfg.ns_restarts, backend != "torch")
    return total


def plain_muon_flops(params: list[torch.Tensor], steps: int = 5) -> float:
    """torch.optim.Muon: standard NS5 on every full matrix, no symmetric kernels."""
    return sum(ns_flops(p.shape[-2], p.shape[-1], "standard", steps, (), False) for p in params)


def graphed_optimizer_class() -> tuple[type | None, str]:
    """(GraphedOptimizer, "") or (None, why it is unavailable)."""
    try:
        from dion3_titan.optim.cuda_graph import GraphedOptimizer
    except Exception as exc:  # the module is optional: report graph rows as unavailable
        return None, f"dion3_titan.optim.cuda_graph unavailable: {type(exc).__name__}: {exc}"
    return GraphedOptimizer, ""


class Runner:
    """What a configuration steps: ``step()``, ``comm_stats`` (or None), ``release()``."""

    def __init__(
        self,
        step: Callable[[], object],
        comm_stats=None,
        release: Callable[[], None] | None = None,
        ns_flops: float | None = 0.0,
        graph_warmup: int = 0,
    ) -> None:
        self.step = step
        self.comm_stats = comm_stats
        self.release = release or (lambda: None)
        self.ns_flops = ns_flops
        self.graph_warmup = graph_warmup


def adamw(params: list[torch.Tensor], device: torch.device, weight_decay: float) -> torch.optim.AdamW:
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=ADAMW_LR, betas=(0.9, 0.95), weight_decay=weight_decay, **impl)


def make_runner(cfg: BenchConfig, model: nn.Module, device: torch.device, graph_cls: type | None) -> Runner:
    if cfg.kind == "adamw":
        opt = adamw(list(model.parameters()), device, cfg.options["weight_decay"])
        return Runner(opt.step)
    groups = build_param_groups(model.named_parameters(), adamw_lr=ADAMW_LR)
    matrices, scalars = groups[0]["params"], groups[1]["params"]
    if cfg.kind == "anchor":
        dion, _ = anchor_module()
        kw = dict(cfg.options)
        cls = getattr(dion, kw.pop("class"))
        mesh = matrices[0].device_mesh if world_size() > 1 else None  # FSDP2's mesh
        opt = cls(
            [{"params": matrices}, {"params": scalars, "algorithm": "adamw", "lr": ADAMW_LR}],
            distributed_mesh=mesh,
            lr=MATRIX_LR,
            **kw,
        )
        if not cfg.graph:
            return Runner(opt.step, ns_flops=None)
        from dion.cuda_graph import CudaGraphOptimizer

        graphed = CudaGraphOptimizer(opt, warmup_steps=GRAPH_WARMUP)
        return Runner(graphed.step, release=graphed.release, ns_flops=None, graph_warmup=GRAPH_WARMUP)
    if cfg.kind == "torch_muon":
        wd = cfg.options["weight_decay"]
        muon = torch.optim.Muon(matrices, lr=MATRIX_LR, weight_decay=wd, momentum=0.95)
        rest = adamw(scalars, device, wd)

        def step() -> None:
            muon.step()
            rest.step()

        return Runner(step, ns_flops=plain_muon_flops(matrices))
    opt = Dion3(groups, lr=MATRIX_LR, **cfg.options)
    try:
        flops = dion3_rank_flops(opt)
    except Exception as exc:  # it reads the plan's internals: a rename must not cost the timing
        print(f"[rank {rank()}] NS FLOP count unavailable for {cfg.name}: {type(exc).__name__}: {exc}")
        flops = None
    stepper = opt if not cfg.graph else graph_cls(opt, warmup_steps=GRAPH_WARMUP)
    step = stepper.step
    if cfg.given_norm:  # the trainer's clipping norm of the (in-place refilled) gradients, a device scalar
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(to_local(p.grad)) for p in model.parameters() if p.grad is not None])
        )

        def step() -> None:
            stepper.use_gradient_norm(norm)
            stepper.step()

    if not cfg.graph:
        return Runner(step, opt.comm_stats, ns_flops=flops)
    return Runner(step, opt.comm_stats, stepper.release, flops, graph_warmup=GRAPH_WARMUP)


def unavailable_reason(cfg: BenchConfig, device: torch.device, graph_note: str) -> str:
    if cfg.kind == "torch_muon":
        if not hasattr(torch.optim, "Muon"):
            return "torch.optim.Muon not in this torch"
        if world_size() > 1:
            return "torch.optim.Muon does not take DTensor shards (world > 1)"
    if cfg.kind == "anchor" and device.type != "cuda":
        return "microsoft/dion's fast path (Triton kernels) needs a GPU"
    if cfg.graph and device.type != "cuda":
        return "CUDA graphs need a GPU"
    if cfg.graph and graph_note:
        return graph_note
    return ""
