"""Optimizer metrics for a training run's logger (both torchtitan adapters log them): measured only on logging steps, so other
steps get no host synchronization and no extra device work.

Reported (names as logged):
- optimizer/gpu_ms, optimizer/host_ms: device time (CUDA events around the step) and host time
  (perf_counter, before any sync) of the step;
- optimizer/comm_MB, optimizer/collectives: bytes this rank received from other ranks and
  collectives issued; optimizer/comm_MB/shard and optimizer/comm_MB/replicate split the bytes by
  link (within a replica, across HSDP replicas);
- optimizer/update_rms/<class>: RMS of the update (lr-scaled) over the matrices of each class
  (attention, mlp, experts, other) and of the AdamW parameters;
- optimizer/selection/covered: share of rows selected at least once in the last ``window`` steps;
  optimizer/selection/oldest_unselected: age in steps of the longest-unselected row;
- optimizer/ns_nonfinite: Newton-Schulz results that were not finite (no update that step),
  optimizer/skipped_steps: steps skipped for non-finite gradients;
- optimizer/peak_mem_GiB: peak device memory allocated during the step.
"""

import time

import torch

from dion3_titan.dist.layout import to_local

# Metrics averaged over model parts (or optimizers); every other one is summed.
AVERAGED = ("update_rms", "selection", "peak_mem")


def combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics of several optimizers (model parts, or one optimizer per name): time
    and communication summed, rates and shares averaged over the parts that report them."""
    out: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    for key in out:
        if any(a in key for a in AVERAGED):
            out[key] /= counts[key]
    return out


def console_line(step: int, metrics: dict[str, float]) -> str:
    """The one console line of a logging step's optimizer metrics."""
    return f"[dion3] step {step:2} " + "  ".join(f"{k[len('optimizer/') :]}={v:.4g}" for k, v in metrics.items())


class OptimizerMetrics:
    """Wraps the step of one Dion3 (or GraphedOptimizer) with measurements on chosen steps."""

    def __init__(self, optimizer, window: int = 100) -> None:
        self.optimizer = optimizer
        self.dion3 = getattr(optimizer, "optimizer", optimizer)  # unwrap GraphedOptimizer
        self.window = window
        self.dion3.track_selection()
        self._pending: dict | None = None

    def step(self, measure: bool) -> None:
        opt, d = self.optimizer, self.dion3
        if not measure:
            opt.step()
            return
        cuda = torch.cuda.is_available() and any(to_local(p).is_cuda for g in d.param_groups for p in g["params"])
        d.comm_stats.reset()
        obs = d.observer
        obs.measure_updates = True
        obs.update_sumsq, obs.update_numel = {}, {}
        adamw_before = self._adamw_snapshot()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        opt.step()
        host_ms = (time.perf_counter() - t0) * 1e3
        if cuda:
            end.record()
        obs.measure_updates = False
        comm = d.comm_stats.copy()
        captured = getattr(opt, "captured_comm", None)
        if captured is not None and getattr(opt, "graph", None) is not None:
            comm = captured  # a replayed graph runs no Python: the captured step's
        self._pending = {
            "events": (start, end) if cuda else None,
            "host_ms": host_ms,
            "comm": comm,
            "adamw": (adamw_before, self._adamw_params()),
            "cuda": cuda,
        }

    def _adamw_params(self) -> list[torch.Tensor]:
        d = self.dion3
        return [to_local(p).detach() for g, c in zip(d.param_groups, d.configs) if c is None for p in g["params"]]

    def _adamw_snapshot(self) -> list[torch.Tensor]:
        # AdamW parameters (embeddings, head, norms) are copied on logging steps only.
        return [p.detach().clone() for p in self._adamw_params()]

    def collect(self) -> dict[str, float]:
        """The metrics of the last measured step (synchronizes)."""
        if self._pending is None:
            return {}
        p, d = self._pending, self.dion3
        out = {
            "optimizer/host_ms": p["host_ms"],
            "optimizer/comm_MB": p["comm"].bytes / 1e6,
            **{f"optimizer/comm_MB/{link}": n / 1e6 for link, n in sorted(p["comm"].by_link.items())},
            "optimizer/collectives": float(p["comm"].calls),
            "optimizer/ns_nonfinite": float(d.nonfinite_ns_events),
            "optimizer/skipped_steps": float(d.skipped_steps),
        }
        if p["events"] is not None:
            torch.cuda.synchronize()
            out["optimizer/gpu_ms"] = p["events"][0].elapsed_time(p["events"][1])
            out["optimizer/peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        for cls, sq in d.observer.update_sumsq.items():
            out[f"optimizer/update_rms/{cls}"] = float((sq / max(d.observer.update_numel[cls], 1)).sqrt())
        before, after = p["adamw"]
        if before:
            sq = sum(float((a.float() - b.float()).square().sum()) for a, b in zip(after, before))
            out["optimizer/update_rms/adamw"] = (sq / max(sum(b.numel() for b in before), 1)) ** 0.5
        covered, oldest = d.observer.selection_stats(self.window)
        out["optimizer/selection/covered"] = float(covered)
        out["optimizer/selection/oldest_unselected"] = float(oldest)
        self._pending = None
        return out
