"""Where one replayed CUDA-graph step spends its time, stream by stream: when each stream's
kernels start and end, how busy each stream is, the idle gaps of the whole device, and the
kernels by total time. bench_step's ``--profile`` says which kernels cost most; this says which
stream the step waits on (with ``ns_overlap`` the costliest shape group runs on a stream of its
own, optim/overlap.py), i.e. what to move or shorten.

    python scripts/profile_timeline.py --model 1b_train                # one GPU
    python scripts/profile_timeline.py --model 7b --layers 8 --list 0 --one-stream

The step is bench_step's ``dion3_f1/4+graph+norm`` configuration (the gradient norm handed in,
as under torchtitan with clipping) unless told otherwise. One profiled replay is traced; the
timed step beside it is the median of untraced replays (CUDA events). Under the profiler the
graph's launch shows as an idle gap before its first kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, field

import torch

from benchmarks.timing import median_ms

# torch.profiler's trace categories of device work
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Span:
    """One piece of device work: start and duration in µs, the stream, the kernel's name."""

    start: float
    dur: float
    stream: int
    name: str

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclass
class StreamUse:
    kernels: int = 0
    busy_us: float = 0.0
    first_us: float = float("inf")
    last_end_us: float = 0.0


@dataclass
class Summary:
    span_us: float
    streams: dict[int, StreamUse]
    union_busy_us: float
    gaps: list[tuple[float, float]]  # (µs from the first span, length µs), largest first
    by_name: list[tuple[str, int, float]] = field(default_factory=list)  # (name, count, µs)


def device_spans(trace_events: list[dict]) -> list[Span]:
    """The device work of a chrome trace (torch.profiler's export), in time order."""
    spans = [
        Span(float(e["ts"]), float(e["dur"]), int(e.get("args", {}).get("stream", -1)), e["name"])
        for e in trace_events
        if e.get("cat") in DEVICE_CATEGORIES and "dur" in e
    ]
    return sorted(spans, key=lambda s: s.start)


def summarize(spans: list[Span], name_width: int = 70) -> Summary:
    """Per-stream use, the device's busy union and its idle gaps, kernels by total time; times
    relative to the first span."""
    if not spans:
        return Summary(0.0, {}, 0.0, [])
    t0 = spans[0].start
    streams: dict[int, StreamUse] = {}
    names: dict[str, list] = {}
    for s in spans:
        use = streams.setdefault(s.stream, StreamUse())
        use.kernels += 1
        use.busy_us += s.dur
        use.first_us = min(use.first_us, s.start - t0)
        use.last_end_us = max(use.last_end_us, s.end - t0)
        entry = names.setdefault(s.name[:name_width], [0, 0.0])
        entry[0] += 1
        entry[1] += s.dur
    union, gaps = 0.0, []
    lo, hi = spans[0].start, spans[0].end
    for s in spans[1:]:
        if s.start > hi:
            union += hi - lo
            gaps.append((hi - t0, s.start - hi))
            lo, hi = s.start, s.end
        else:
            hi = max(hi, s.end)
    union += hi - lo
    span = max(s.end for s in spans) - t0
    by_name = sorted(((n, c, d) for n, (c, d) in names.items()), key=lambda x: -x[2])
    return Summary(span, streams, union, sorted(gaps, key=lambda g: -g[1]), by_name)


def report(summary: Summary, spans: list[Span], top: int, listed: int) -> list[str]:
    ms = 1e-3
    lines = [
        f"traced span {summary.span_us * ms:.3f} ms; device busy (any stream) {summary.union_busy_us * ms:.3f} ms; "
        f"idle {sum(g for _, g in summary.gaps) * ms:.3f} ms in {len(summary.gaps)} gaps, the largest: "
        + ", ".join(f"{g:.0f} µs at {at * ms:.2f} ms" for at, g in summary.gaps[:5])
    ]
    for sid, use in sorted(summary.streams.items(), key=lambda kv: kv[1].first_us):
        lines.append(
            f"stream {sid}: {use.kernels} kernels, busy {use.busy_us * ms:.3f} ms, from {use.first_us * ms:.3f} "
            f"to {use.last_end_us * ms:.3f} ms"
        )
    lines.append(f"kernels by total time (top {top}):")
    lines += [f"  {d * ms:8.3f} ms x{c:4d}  {n}" for n, c, d in summary.by_name[:top]]
    if listed and spans:
        t0 = spans[0].start
        lines.append(f"the first {listed} spans in time order (stream, start ms, µs, name):")
        lines += [f"  s{s.stream:<4d} {(s.start - t0) * ms:8.3f} {s.dur:9.1f}  {s.name[:80]}" for s in spans[:listed]]
    return lines


def trace_once(step) -> list[Span]:
    """One call of ``step`` under torch.profiler (device activity), as spans."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return device_spans(json.load(f)["traceEvents"])
    finally:
        os.unlink(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b_train", help="a bench_step model (benchmarks/llama.py)")
    p.add_argument("--layers", default="", help="this many layers instead of the model's")
    p.add_argument("--flavor", default="normuon", choices=["muon", "normuon"])
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--own-pass", action="store_true", help="the optimizer's own finiteness pass (no norm handed in)")
    p.add_argument("--one-stream", action="store_true", help="ns_overlap = false")
    p.add_argument("--steps", type=int, default=15, help="untraced replays timed")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--list", type=int, default=300, help="list this many spans in time order")
    p.add_argument(
        "--out", default="", help="also write the timed median, the spans and the arguments to this JSON file"
    )
    return p.parse_args(argv)


def build(a: argparse.Namespace):
    """(runner, gradient filler) of the captured step on the model's shapes."""
    from benchmarks.llama import GradFiller, build_model
    from benchmarks.step import model_shape
    from benchmarks.step import parse_args as step_args
    from benchmarks.step_configs import WEIGHT_DECAY, BenchConfig
    from benchmarks.step_runners import graphed_optimizer_class, make_runner

    _, shape, _ = model_shape(step_args(["--model", a.model] + (["--layers", a.layers] if a.layers else [])))
    device = torch.device("cuda")
    model = build_model(shape, device, None, 0)
    grads = GradFiller(model, device, 0)
    options = {"flavor": a.flavor, "fraction": a.fraction, "weight_decay": WEIGHT_DECAY, "ns_overlap": not a.one_stream}
    cfg = BenchConfig("timeline", "timeline", "dion3", options, graph=True, given_norm=not a.own_pass)
    graph_cls, why = graphed_optimizer_class()
    if graph_cls is None:
        raise SystemExit(why)
    return make_runner(cfg, model, device, graph_cls), grads


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: it traces a replayed CUDA graph")
    runner, grads = build(a)
    # eager steps, the capture, replays; then replays timed, each on fresh gradients
    timed = median_ms(runner.step, torch.device("cuda"), a.steps, runner.graph_warmup + 3, before=grads.fill)
    grads.fill()
    spans = trace_once(runner.step)
    runner.release()
    summary = summarize(spans)
    print(
        f"{torch.cuda.get_device_name()}, {a.model}{' ' + a.layers + ' layers' if a.layers else ''}, {a.flavor} "
        f"f={a.fraction:g}, {'own finiteness pass' if a.own_pass else 'norm given'}, "
        f"{'one stream' if a.one_stream else 'ns_overlap'}: timed step {timed:.3f} ms "
        f"(median of {a.steps} replays)"
    )
    print("\n".join(report(summary, spans, a.top, a.list)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"timed_median_ms": timed, "spans": [vars(s) for s in spans], "args": vars(a)}, f)
