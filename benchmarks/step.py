"""Time one optimizer step of AdamW, Muon and Dion3 on Llama-shaped parameters (paper Sec. 8.2,
App. D.2, Fig. 1, Tables 1, 5, 6).

The model is a plain holder of parameters with the shapes of paper Table 4 (separate
wq/wk/wv/wo and w1/w2/w3 as torchtitan's llama3 has them, fp32 as FSDP2 keeps them). No
forward pass: every step's gradients are fresh N(0, 1) draws (fixed seed, never zeros) written
in place into the same ``p.grad`` tensors, which is what a CUDA-graph replay needs. Under
torchrun with more than one rank every layer and then the root are ``fully_shard``-ed (FSDP2).

Per configuration (all in one run):
  * GPU ms: median over ``--steps`` steps of CUDA events around ``step()`` (after warm-up), the
    per-step maximum over ranks; on a CPU, perf_counter (the CPU runs synchronously);
  * host ms: perf_counter around ``step()``, stopped before any sync of ours (it includes the
    optimizer's own host syncs: eager Dion3 checks gradients and NS results for finiteness);
  * comm MB: bytes received by a rank in one step, from ``opt.comm_stats`` (reset before the
    step; a replayed graph runs no Python, so graph rows report their last eager step's count);
  * NS TFLOP / floor ms: the Newton-Schulz FLOPs this rank runs, counted from the optimizer's
    own plan (padded shapes, owners, Gram vs standard, symmetric products at half cost where
    the backend has symmetric kernels), over the bf16/fp16 matmul rate measured in this run.

    python scripts/bench_step.py --model 7b --layers 16 --budget-s 180          # 1 GPU, ~3 min
    torchrun --nproc_per_node 2 scripts/bench_step.py --model 1b --budget-s 180  # 2 GPUs, ~1.5 min
    python scripts/bench_step.py --tiny                                          # CPU smoke test

When ``import dion`` works (microsoft/dion, the paper authors' code, on PYTHONPATH) the same run
adds its rows: ``dion.Muon`` with Gram NS + kernels and its Dion3-family optimizer of the
benchmarked flavor (``Dion3`` for NorMuon, ``Dion2`` for Muon) at f = 1, 1/2, 1/4, eager and
under its ``CudaGraphOptimizer``; the xDion column divides our row by its counterpart.

Execution order puts the eager stack first, then the graph rows, then torch.optim.Muon and
megabatching off; ``--budget-s`` skips (and reports) any configuration predicted to end past it.

A table is printed at the end; JSON goes to ``--out`` (a .json file or a folder; default $OUT), named
bench_step_<model>_<flavor>_w<world>.json in a folder, rewritten after every configuration.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.llama import MODELS, GradFiller, ModelShape, build_model, count_params
from benchmarks.output import fmt, output_path, write_json
from benchmarks.ranks import all_ranks_true, barrier, init_distributed, log, rank, reduce_max, world_size
from benchmarks.timing import copy_gbps, matmul_tflops
from dion3_titan import Dion3
from dion3_titan.dist.layout import to_local
from dion3_titan.kernels.flops import ns_flops
from dion3_titan.optim.routing import build_param_groups

MATRIX_LR = 0.02
ADAMW_LR = 3e-4
WEIGHT_DECAY = 0.01
GRAPH_WARMUP = 3  # GraphedOptimizer's eager steps before it captures


# ----------------------------------------------------------------------------- FLOP counts
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


# ----------------------------------------------------------------------------- configurations
@dataclass
class BenchConfig:
    name: str
    label: str
    kind: str  # "adamw" | "torch_muon" | "dion3" | "anchor" (microsoft/dion)
    options: dict = field(default_factory=dict)  # Dion3 (or the anchor class's) keyword arguments
    graph: bool = False


def build_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """AdamW, torch.optim.Muon, Muon on our engine, then Dion3 adding one contribution at a
    time (paper Fig. 1 / Table 5 order), each Dion3 step with and without a CUDA graph, and
    Dion3 f = 1 without megabatching (Table 1)."""
    base = {"flavor": args.flavor, "weight_decay": WEIGHT_DECAY}
    muon = {
        **base,
        "fraction": 1.0,
        "ns_algorithm": "standard",
        "ns_coefficients": "muon",
        "ns_dtype": "bfloat16",
        "backend": "torch",
        "megabatch": False,
    }
    f1_torch = {**base, "fraction": 1.0, "ns_algorithm": "standard", "backend": "torch"}
    f1_kernels = {**f1_torch, "backend": args.kernels}
    gram = {**f1_kernels, "ns_algorithm": args.gram_algorithm}
    configs = [
        BenchConfig("adamw", "AdamW (torch fused)" if args.device == "cuda" else "AdamW (torch foreach)", "adamw"),
        BenchConfig("muon_torch", "torch.optim.Muon (per matrix, NS5 bf16)", "torch_muon"),
        BenchConfig("muon", "Muon: standard NS5, torch, no megabatch", "dion3", muon),
    ]
    stack = [
        ("dion3_f1_torch", "Dion3 f=1: standard NS (polar express), torch", f1_torch),
        ("dion3_f1_kernels", f"+ kernels ({args.kernels})", f1_kernels),
        ("dion3_f1_gram", f"+ Gram NS ({args.gram_algorithm})", gram),
        ("dion3_f1/2", "+ f=1/2", {**gram, "fraction": 0.5}),
        ("dion3_f1/4", "+ f=1/4", {**gram, "fraction": 0.25}),
    ]
    for name, label, options in stack:
        configs.append(BenchConfig(name, label, "dion3", options))
        configs.append(BenchConfig(name + "+graph", label + " + CUDA graph", "dion3", options, graph=True))
        if name == "dion3_f1_torch":
            configs.append(
                BenchConfig(
                    "dion3_f1_torch_nomb",
                    "Dion3 f=1 torch, megabatch off (Table 1)",
                    "dion3",
                    {**f1_torch, "megabatch": False},
                )
            )
    configs += anchor_configs(args)
    if args.only:
        patterns = args.only.split(",")
        configs = [c for c in configs if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    return configs


# microsoft/dion (the paper authors' code), timed beside ours when ``import dion`` works.
# Its Dion3 is the NorMuon flavor (NorDion2); Dion2 is the same algorithm in the Muon flavor.
ANCHOR_CLASS = {"normuon": "Dion3", "muon": "Dion2"}
ANCHOR_FAST = {"use_gram_newton_schulz": True, "use_triton": True}


def anchor_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """dion.Muon (Gram NS + kernels) and dion's Dion3-family optimizer of this flavor at f = 1,
    1/2 and 1/4, each eager and under dion's own CudaGraphOptimizer; none when ``import dion``
    fails (a note says so)."""
    if anchor_module()[0] is None:
        return []
    import importlib.util

    fast, ns = dict(ANCHOR_FAST), "Gram NS + kernels"
    if importlib.util.find_spec("cutlass") is None:  # its Gram NS runs on quack's CuteDSL kernels
        fast["use_gram_newton_schulz"], ns = False, "standard NS + Triton kernels (no CuteDSL here)"
    cls = ANCHOR_CLASS[args.flavor]
    rows = [("dion_muon", f"microsoft/dion Muon ({ns})", "Muon", dict(fast))]
    for tag, f in (("f1", 1.0), ("f1/2", 0.5), ("f1/4", 0.25)):
        rows.append(
            (
                f"dion_{tag}",
                f"microsoft/dion {cls} {tag.replace('f', 'f=')} ({ns})",
                cls,
                {**fast, "fraction": f, "triton_post_ortho": True},
            )
        )
    out = []
    for name, label, cls_name, kw in rows:
        options = {"class": cls_name, **kw}
        out.append(BenchConfig(name, label, "anchor", options))
        out.append(BenchConfig(name + "+graph", label + " + its CUDA graph", "anchor", options, graph=True))
    return out


def anchor_module() -> tuple[object | None, str]:
    """(the ``dion`` package, "") or (None, why it cannot be imported)."""
    try:
        import dion
    except Exception as exc:
        return None, f"import dion failed: {type(exc).__name__}: {str(exc)[:120]}"
    return dion, ""


# Each of our rows and the anchor row it is compared with (same f, same graph setting).
ANCHOR_PAIRS = {"dion3_f1_gram": "dion_f1", "dion3_f1/2": "dion_f1/2", "dion3_f1/4": "dion_f1/4"}


def anchor_of(name: str, flavor: str) -> str | None:
    base, graph = name.removesuffix("+graph"), name.endswith("+graph")
    pair = ANCHOR_PAIRS.get(base)
    if pair is None and base == "muon":
        pair = "dion_muon"
    if pair == "dion_f1" and flavor == "muon":
        pair = "dion_muon"  # Muon flavor at f = 1: the authors' Muon
    return None if pair is None else pair + ("+graph" if graph else "")


def run_priority(cfg: BenchConfig) -> int:
    """Execution order (the table keeps the paper's order): the eager stack first, then the
    graph rows, then the extra baselines, so a ``--budget-s`` cut drops the least essential."""
    if cfg.graph:
        return 1
    if cfg.name in ("muon_torch", "dion3_f1_torch_nomb"):
        return 2
    return 0


def estimate_s(cfg: BenchConfig, walls: dict[str, float]) -> float:
    """Seconds a configuration should take, from a measured twin (0 when none ran yet): a
    graph row costs what its eager row did (+10% for its longer warm-up); the extra baselines
    what the rows they extend did."""
    twin = {"muon_torch": "muon", "dion3_f1_torch_nomb": "dion3_f1_torch"}.get(
        cfg.name, cfg.name.removesuffix("+graph")
    )
    return 1.1 * walls.get(twin, 0.0) if twin != cfg.name else 0.0


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


def adamw(params: list[torch.Tensor], device: torch.device) -> torch.optim.AdamW:
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=ADAMW_LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY, **impl)


def make_runner(cfg: BenchConfig, model: nn.Module, device: torch.device, graph_cls: type | None) -> Runner:
    if cfg.kind == "adamw":
        opt = adamw(list(model.parameters()), device)
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
            weight_decay=WEIGHT_DECAY,
            **kw,
        )
        if not cfg.graph:
            return Runner(opt.step, ns_flops=None)
        from dion.cuda_graph import CudaGraphOptimizer

        graphed = CudaGraphOptimizer(opt, warmup_steps=GRAPH_WARMUP)
        return Runner(graphed.step, release=graphed.release, ns_flops=None, graph_warmup=GRAPH_WARMUP)
    if cfg.kind == "torch_muon":
        muon = torch.optim.Muon(matrices, lr=MATRIX_LR, weight_decay=WEIGHT_DECAY, momentum=0.95)
        rest = adamw(scalars, device)

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
    if not cfg.graph:
        return Runner(opt.step, opt.comm_stats, ns_flops=flops)
    graphed = graph_cls(opt, warmup_steps=GRAPH_WARMUP)
    return Runner(graphed.step, opt.comm_stats, graphed.release, flops, graph_warmup=GRAPH_WARMUP)


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


# ----------------------------------------------------------------------------- timing
@dataclass
class Timings:
    device_ms: list[float]
    host_ms: list[float]
    comm_bytes: list[int]
    eager_comm_bytes: int


def time_steps(runner: Runner, grads: GradFiller, device: torch.device, warmup: int, steps: int) -> Timings:
    """Per timed step: grads filled, device idle and ranks aligned, then events and
    perf_counter around ``step()`` (the host clock stops before any sync of ours)."""
    on_gpu = device.type == "cuda"
    device_ms, host_ms, comm = [], [], []
    eager_comm = 0
    grads.reseed()
    for i in range(warmup + steps):
        grads.fill()
        if runner.comm_stats is not None:
            runner.comm_stats.reset()
        barrier(device)
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        runner.step()
        t1 = time.perf_counter()
        if on_gpu:
            end.record()
            end.synchronize()
        nbytes = runner.comm_stats.bytes if runner.comm_stats is not None else 0
        if i < runner.graph_warmup or not runner.graph_warmup:
            eager_comm = nbytes
        if i >= warmup:
            host_ms.append((t1 - t0) * 1e3)
            device_ms.append(start.elapsed_time(end) if on_gpu else (t1 - t0) * 1e3)
            comm.append(nbytes)
    return Timings(device_ms, host_ms, comm, eager_comm)


def profile_step(runner: Runner, grads: GradFiller, name: str, top: int) -> None:
    """Where one step's device time goes: its ``top`` kernels by total device time (one more
    step, under torch.profiler, after the timed ones)."""
    from torch.profiler import ProfilerActivity, profile

    grads.fill()
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        runner.step()
        if on_gpu:
            torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total", row_limit=top, max_name_column_width=70
    )
    log(f"profile of one {name} step (top {top} by device time):\n{table}")
    if on_gpu:  # the same step by the torch ops that launched the kernels (eager steps only)
        ops = [e for e in prof.key_averages() if e.key.startswith("aten::") and e.device_time_total > 0]
        ops.sort(key=lambda e: -e.device_time_total)
        log(
            "  device time by op (includes the kernels each launches): "
            + ", ".join(f"{e.key} {e.device_time_total / 1e3:.2f} ms x{e.count}" for e in ops[:top])
        )


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def not_run(cfg: BenchConfig, status: str, note: str) -> dict:
    """The table row of a configuration that did not run, and why."""
    return {
        "name": cfg.name,
        "label": cfg.label,
        "kind": cfg.kind,
        "graph": cfg.graph,
        "options": cfg.options,
        "status": status,
        "note": note,
    }


def run_config(
    cfg: BenchConfig,
    model: nn.Module,
    grads: GradFiller,
    device: torch.device,
    args: argparse.Namespace,
    graph_cls: type | None,
) -> dict:
    """One configuration: build, warm up, time, tear down. Failures become a status + note."""
    row: dict = {
        "name": cfg.name,
        "label": cfg.label,
        "kind": cfg.kind,
        "graph": cfg.graph,
        "options": dict(cfg.options),
    }
    warmup = max(args.warmup, GRAPH_WARMUP + 2) if cfg.graph else args.warmup
    runner = None
    ok, note, ns = True, "", None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        runner = make_runner(cfg, model, device, graph_cls)
        ns = runner.ns_flops
        t = time_steps(runner, grads, device, warmup, args.steps)
        if args.profile and rank() == 0:
            profile_step(runner, grads, cfg.name, args.profile)
    except Exception as exc:
        if args.strict and not is_oom(exc):
            raise
        ok = False
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        note = ("OOM: " if is_oom(exc) else f"error: {type(exc).__name__}: ") + first[:200]
        if not is_oom(exc):
            traceback.print_exc()
    finally:
        if runner is not None:
            try:
                runner.release()
            except Exception as exc:  # never let teardown hide the row
                note = note or f"release failed: {exc}"
        del runner
        free_memory(device)
    row["_ns_flops"] = ns
    ok = all_ranks_true(ok, device)
    if not ok:
        row.update(status="oom" if note.startswith("OOM") else "error", note=note or "failed on another rank")
        return row
    dev_ms = reduce_max(t.device_ms, device)
    host = reduce_max(t.host_ms, device)
    comm = reduce_max([float(b) for b in t.comm_bytes] + [float(t.eager_comm_bytes)], device)
    q1, med, q3 = quartiles(dev_ms)
    step_comm = comm[-1] if cfg.graph else statistics.median(comm[:-1]) if comm[:-1] else 0.0
    row.update(
        status="ok",
        note="comm from an eager warm-up step" if cfg.graph and step_comm else "",
        gpu_ms=med,
        gpu_ms_q1=q1,
        gpu_ms_q3=q3,
        gpu_ms_all=dev_ms,
        host_ms=statistics.median(host),
        comm_mb=step_comm / 1e6,
        peak_mem_gb=(torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
    )
    return row


def ns_rate(row: dict, tflops: dict[str, float]) -> float:
    """The measured matmul TFLOP/s of the dtype a row's Newton-Schulz runs in."""
    bf16 = row["kind"] == "torch_muon" or row["options"].get("ns_dtype") == "bfloat16"
    return tflops["bfloat16" if bf16 else "float16"]


def attach_flops(
    rows: list[dict], flops: dict[str, float | None], tflops: dict[str, float], device: torch.device
) -> None:
    """NS TFLOP of the busiest rank and its floor at the measured matmul rate (None: unknown)."""
    names = list(flops)
    worst = reduce_max([-1.0 if flops[n] is None else flops[n] for n in names], device)
    for row in rows:
        if row["name"] in flops and row.get("status") == "ok":
            f = worst[names.index(row["name"])]
            row["ns_tflop"] = f / 1e12 if f >= 0 else None
            row["floor_ms"] = f / (ns_rate(row, tflops) * 1e12) * 1e3 if f >= 0 else None


def attach_adamw_floor(rows: list[dict], model: nn.Module, gbps: float, device: torch.device) -> None:
    """AdamW has no NS: its floor is memory, fp32 p, g, m, v read and p, m, v written (28 B
    per local parameter) at the measured copy bandwidth."""
    row = next((r for r in rows if r["name"] == "adamw" and r.get("status") == "ok"), None)
    local = sum(to_local(p).numel() for p in model.parameters())
    floor = reduce_max([28.0 * local / (gbps * 1e9) * 1e3], device)[0]
    if row is not None:
        row["floor_ms"] = floor
        row["note"] = "floor: memory, 28 B/param at the copy bandwidth"


def attach_ratios(rows: list[dict], flavor: str) -> None:
    ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
    for row in rows:
        if row.get("status") != "ok":
            continue
        for ref, key in (("muon", "x_muon"), ("adamw", "x_adamw"), (anchor_of(row["name"], flavor), "x_dion")):
            row[key] = row["gpu_ms"] / ok[ref]["gpu_ms"] if ref in ok and ok[ref]["gpu_ms"] > 0 else None


# ----------------------------------------------------------------------------- output
def print_table(meta: dict, rows: list[dict]) -> None:
    print(f"\n{meta['title']}")
    for n in meta["notes"]:
        print(f"NOTE: {n}")
    head = (
        f"{'config':<22} {'GPU ms':>9} {'IQR':>13} {'xMuon':>6} {'xAdamW':>7} {'xDion':>6} {'host ms':>8} "
        f"{'comm MB':>8} {'NS TFLOP':>9} {'floor ms':>9} {'mem GB':>7}  note"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        iqr = f"{r['gpu_ms_q1']:.1f}-{r['gpu_ms_q3']:.1f}" if r.get("status") == "ok" else "-"
        note = r.get("note", "") if r.get("status") == "ok" else f"[{r.get('status')}] {r.get('note', '')}"
        print(
            f"{r['name']:<22} {fmt(r.get('gpu_ms'), '.2f', 9)} {iqr:>13} {fmt(r.get('x_muon'), '.2f', 6)} "
            f"{fmt(r.get('x_adamw'), '.1f', 7)} {fmt(r.get('x_dion'), '.2f', 6)} {fmt(r.get('host_ms'), '.2f', 8)} {fmt(r.get('comm_mb'), 'auto', 8)} "
            f"{fmt(r.get('ns_tflop'), 'auto', 9)} {fmt(r.get('floor_ms'), 'auto', 9)} "
            f"{fmt(r.get('peak_mem_gb'), '.1f', 7)}  {note}"
        )


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="7b", choices=[m for m in MODELS if m != "tiny"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--layers", type=int, default=None, help="use this many layers instead of the model's")
    p.add_argument("--vocab", type=int, default=None, help="embedding/output rows (default 32000)")
    p.add_argument("--flavor", default="muon", choices=["muon", "normuon"])
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "triton", "cute"],
        help="backend of the '+ kernels' rows and after",
    )
    p.add_argument(
        "--gram-algorithm",
        default="gram",
        choices=["gram", "auto"],
        help="'auto' runs standard NS on square matrices (the paper's fallback)",
    )
    p.add_argument("--steps", type=int, default=25, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (graph rows: at least 5)")
    p.add_argument("--only", default="", help="comma-separated glob patterns of config names")
    p.add_argument(
        "--budget-s", type=float, default=1e9, help="skip configurations predicted to end after this many seconds"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="re-raise errors other than OOM (tests)")
    p.add_argument("--out", default=None, help="JSON file or folder (default $OUT)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing each configuration, print its N costliest kernels (GPU)",
    )
    return p.parse_args(argv)


def model_shape(args: argparse.Namespace) -> tuple[str, ModelShape, list[str]]:
    name = "tiny" if args.tiny else args.model
    shape = MODELS[name]
    notes = []
    if args.layers is not None and args.layers != shape.layers:
        notes.append(
            f"{args.layers} of {shape.layers} layers of the {name} shapes (--layers): "
            "step times cover that many layers; embeddings/output are whole"
        )
        shape = ModelShape(shape.hidden, args.layers, shape.heads, shape.kv_heads, shape.mlp_hidden, shape.vocab)
    if args.vocab is not None:
        shape = ModelShape(shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.mlp_hidden, args.vocab)
    return name, shape, notes


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.time()
    device, mesh = init_distributed(args.device)
    world = world_size()
    name, shape, notes = model_shape(args)
    torch.manual_seed(args.seed)
    graph_cls, graph_note = graphed_optimizer_class()
    if graph_note and device.type == "cuda":
        notes.append(graph_note)
    anchor_note = anchor_module()[1]
    if anchor_note:
        notes.append(f"no microsoft/dion rows: {anchor_note}")

    size = (2, 128) if args.tiny else (4, 8192)  # (batch, side) of the measured matmul
    tflops = matmul_tflops(device, torch.float16, *size)
    tflops_bf16 = matmul_tflops(device, torch.bfloat16, *size)
    gbps = copy_gbps(device, (1 << 16) if args.tiny else (1 << 28))
    free_memory(device)
    log(
        f"{describe_device(device)} x{world}: matmul fp16 {tflops:.3g} / bf16 {tflops_bf16:.3g} TFLOP/s, "
        f"copy {gbps:.0f} GB/s"
    )

    model = build_model(shape, device, mesh, args.seed)
    grads = GradFiller(model, device, args.seed + 1)
    n_params = count_params(shape)
    size = f"{n_params / 1e9:.2f}B" if n_params >= 1e7 else f"{n_params / 1e6:.2f}M"
    title = (
        f"{name} ({size} params: hidden {shape.hidden}, {shape.layers} layers, "
        f"heads {shape.heads}/{shape.kv_heads}, mlp {shape.mlp_hidden}, vocab {shape.vocab}) | "
        f"{describe_device(device)} x{world}{' FSDP2' if world > 1 else ''} | flavor {args.flavor} | "
        f"median of {args.steps} steps, ms"
    )
    log(title)
    for n in notes:
        log(f"NOTE: {n}")
    meta = {
        "title": title,
        "notes": notes,
        "model": name,
        "shape": shape.__dict__,
        "params": n_params,
        "device": describe_device(device),
        "world": world,
        "fsdp2": world > 1,
        "flavor": args.flavor,
        "kernels": args.kernels,
        "gram_algorithm": args.gram_algorithm,
        "steps": args.steps,
        "warmup": args.warmup,
        "matmul_tflops_fp16": tflops,
        "matmul_tflops_bf16": tflops_bf16,
        "copy_gbps": gbps,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "timer": "cuda events" if device.type == "cuda" else "perf_counter (cpu)",
        "graph_warmup_steps": GRAPH_WARMUP,
        "complete": False,
    }
    path = output_path(args.out, f"bench_step_{name}_{args.flavor}_w{world}.json") if rank() == 0 else None

    rows: list[dict] = []
    flops: dict[str, float | None] = {}
    walls: dict[str, float] = {}
    configs = build_configs(args)
    for cfg in sorted(configs, key=run_priority):
        why = unavailable_reason(cfg, device, graph_note)
        if why:
            rows.append(not_run(cfg, "unavailable", why))
            continue
        expected_end = time.time() - t_start + estimate_s(cfg, walls)
        if not all_ranks_true(expected_end < args.budget_s, device):
            rows.append(
                not_run(cfg, "skipped", f"would end after --budget-s {args.budget_s:.0f} (at ~{expected_end:.0f} s)")
            )
            log(f"  {cfg.name:<22} skipped (budget)")
            continue
        t_cfg = time.time()
        row = run_config(cfg, model, grads, device, args, graph_cls)
        row["wall_s"] = walls[cfg.name] = time.time() - t_cfg
        flops[cfg.name] = row.pop("_ns_flops", None)
        rows.append(row)
        write_json(path, {"meta": meta, "results": rows})  # partial results survive a later crash
        log(
            f"  {cfg.name:<22} {row['status']:<6} {fmt(row.get('gpu_ms'), '.2f', 9)} ms "
            f"({row['wall_s']:.0f} s) {row.get('note', '')}"
        )
    order = [c.name for c in configs]
    rows.sort(key=lambda r: order.index(r["name"]))
    attach_flops(rows, flops, {"float16": tflops, "bfloat16": tflops_bf16}, device)
    attach_adamw_floor(rows, model, gbps, device)
    attach_ratios(rows, args.flavor)

    meta.update(wall_s=time.time() - t_start, complete=True)
    if rank() == 0:
        print_table(meta, rows)
        write_json(path, {"meta": meta, "results": rows})
        if path is not None:
            print(f"wrote {path}")
        print(f"total {time.time() - t_start:.0f} s")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
