"""Timing one configuration of scripts/bench_step.py: warm-up, timed steps (device, host and
communication per step, the maximum over ranks), an optional profile, and teardown; a failure
becomes the row's status and note."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn

from benchmarks.llama import GradFiller
from benchmarks.ranks import all_ranks_true, barrier, log, rank, reduce_max
from benchmarks.step_configs import GRAPH_WARMUP, BenchConfig
from benchmarks.step_runners import Runner, make_runner
from benchmarks.timing import quartiles, sync


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


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def free_memory(device: torch.device) -> None:
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def config_row(cfg: BenchConfig) -> dict:
    """The columns of a row that say which configuration it is."""
    return {
        "name": cfg.name,
        "label": cfg.label,
        "kind": cfg.kind,
        "graph": cfg.graph,
        "given_norm": cfg.given_norm,
        "options": dict(cfg.options),
        "settings": [f"{module}.{attr}={value!r}" for module, attr, value in cfg.settings],
    }


def not_run(cfg: BenchConfig, status: str, note: str) -> dict:
    """The table row of a configuration that did not run, and why."""
    return {**config_row(cfg), "status": status, "note": note}


def run_config(
    cfg: BenchConfig,
    model: nn.Module,
    grads: GradFiller,
    device: torch.device,
    args: argparse.Namespace,
    graph_cls: type | None,
) -> dict:
    """One configuration: build, warm up, time, tear down. Failures become a status + note."""
    row = config_row(cfg)
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
    notes = [note] + (["comm from an eager warm-up step"] if cfg.graph and step_comm else [])
    row.update(
        status="ok",
        note="; ".join(n for n in notes if n),  # a failed release is reported on a timed row too
        gpu_ms=med,
        gpu_ms_q1=q1,
        gpu_ms_q3=q3,
        gpu_ms_all=dev_ms,
        host_ms=statistics.median(host),
        comm_mb=step_comm / 1e6,
        peak_mem_gb=(torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
    )
    return row
