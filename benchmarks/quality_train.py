"""One run of scripts/quality_run.py: training from the shared initial weights under the
warmup-stable-cooldown schedule, validation every ``--eval-every`` steps, forward+backward and
optimizer-step times; and the calibration that fits the number of steps to a time budget."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
import torch
from torch import nn

from benchmarks.quality_data import TrainBatches
from benchmarks.quality_optim import RunSpec, make_optimizer
from benchmarks.timing import RegionTimer, sync


def lr_multiplier(step: int, steps: int, warmup: int, cooldown_frac: float, final: float) -> float:
    """Warmup-stable-cooldown (App. D.1): linear 0 -> 1 over ``warmup`` steps, 1, then linear
    1 -> ``final`` over the last ``cooldown_frac`` of the steps. ``step`` counts from 0."""
    cooldown_start = int(round(steps * (1.0 - cooldown_frac)))
    if step < warmup:
        return (step + 1) / warmup
    if step < cooldown_start:
        return 1.0
    progress = (step - cooldown_start + 1) / max(1, steps - cooldown_start)
    return 1.0 + (final - 1.0) * progress


def bf16_autocast(device: torch.device) -> Callable[[], torch.autocast]:
    """A fresh bf16 autocast context per call on a GPU; a disabled one on a CPU (fp32)."""
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, autocast: Callable) -> float:
    total, count = 0.0, 0
    for x, y in batches:
        with autocast():
            loss = model(x, y)
        total += float(loss) * y.numel()
        count += y.numel()
    return total / count


def train_one(
    spec: RunSpec,
    model: nn.Module,
    init_state: dict,
    data: TrainBatches,
    val: list,
    args: argparse.Namespace,
    device: torch.device,
) -> dict:
    """One run from the shared initial weights; returns its curves and timings."""
    model.load_state_dict(init_state)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    opt = make_optimizer(spec, model, args, fused=device.type == "cuda")
    # floats: microsoft/dion keeps each group's lr in a persistent device tensor and copies
    # whatever is assigned into it, so holding that tensor here would compound the schedule
    base_lrs = [float(g["lr"]) for g in opt.param_groups]
    autocast = bf16_autocast(device)
    fb_timer, opt_timer = RegionTimer(device.type == "cuda"), RegionTimer(device.type == "cuda")
    result: dict = {"spec": asdict(spec), "status": "ok", "val": [], "train": [], "host_opt_ms": []}
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step % args.eval_every == 0:
            result["val"].append([step, evaluate(model, val, autocast)])
        mult = lr_multiplier(step, args.steps, args.warmup, args.cooldown_frac, args.final_lr_frac)
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base * mult
        x, y = data(step)
        begin = fb_timer.start()
        with autocast():
            loss = model(x, y)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        fb_timer.stop(begin)
        loss_value = float(loss.detach())  # syncs: the step timer below then sees the optimizer alone
        result["train"].append(loss_value)
        if not math.isfinite(loss_value):
            result["status"] = f"diverged at step {step}"
            break
        host = time.perf_counter()
        begin = opt_timer.start()
        opt.step()
        opt_timer.stop(begin)
        result["host_opt_ms"].append(round((time.perf_counter() - host) * 1e3, 4))
        opt.zero_grad(set_to_none=True)
    else:
        result["val"].append([args.steps, evaluate(model, val, autocast)])
    sync(device)
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    result["fwd_bwd_ms"] = fb_timer.millis()
    result["opt_ms"] = opt_timer.millis()
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    result.update(summarize(result, args.steps))
    return result


def summarize(result: dict, steps: int) -> dict:
    """Headline numbers; step-time medians skip the first 5 steps (kernel compiles, allocs)."""

    def median(xs: list[float]) -> float | None:
        tail = xs[5:] if len(xs) > 10 else xs
        return round(float(np.median(tail)), 4) if tail else None

    done = result["status"] == "ok"
    return {
        "final_val": result["val"][-1][1] if done and result["val"] else None,
        "min_val": min(v for _, v in result["val"]) if result["val"] else None,
        "median_opt_ms": median(result["opt_ms"]),
        "median_host_opt_ms": median(result["host_opt_ms"]),
        "median_fwd_bwd_ms": median(result["fwd_bwd_ms"]),
        "total_opt_s": round(sum(result["opt_ms"]) / 1e3, 4),
        "steps_done": len(result["opt_ms"]),
        "steps": steps,
    }


def calibrate_steps(
    model: nn.Module, init_state: dict, data: TrainBatches, args: argparse.Namespace, n_runs: int, device: torch.device
) -> dict:
    """Time a few AdamW steps and shrink ``args.steps`` (to a multiple of 10) if all runs would
    not fit in ``--time-budget-s``. Orthogonalizing optimizers are assumed to cost
    ``--overhead`` times an AdamW step; evals are ignored (each is a few forward passes)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=device.type == "cuda")
    autocast = bf16_autocast(device)
    times = []
    for step in range(args.calibration_steps + 3):
        sync(device)
        t = time.perf_counter()
        x, y = data(step)
        with autocast():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t)
    model.load_state_dict(init_state)
    del opt
    per_step = float(np.median(times[3:]))
    fit = int(args.time_budget_s / (n_runs * per_step * args.overhead)) // 10 * 10
    info = {"adamw_step_s": round(per_step, 5), "requested_steps": args.steps, "fit_steps": fit}
    if 0 < fit < args.steps:
        args.steps = max(fit, args.min_steps)
    info["steps"] = args.steps
    return info
