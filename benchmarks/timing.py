"""Timers and measured ceilings shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

Timer = Callable[[Callable[[], object]], float]  # milliseconds of one call of its argument


class RegionTimer:
    """Device time of code regions: CUDA events recorded around each on a GPU (read after the
    caller's own sync, so timing adds none of its own), perf_counter on a CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.pairs: list = []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, begin) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pairs.append((begin, e))
        else:
            self.pairs.append((begin, time.perf_counter()))

    def millis(self) -> list[float]:
        """Every region's ms (rounded to 0.1 us), after a synchronize."""
        if self.cuda:
            torch.cuda.synchronize()
        return [round(self._ms(pair), 4) for pair in self.pairs]

    def last_ms(self) -> float:
        """The last region's ms (0 before any); on a GPU its end must have been reached."""
        return self._ms(self.pairs[-1]) if self.pairs else 0.0

    def _ms(self, pair: tuple) -> float:
        a, b = pair
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def sync(device: torch.device) -> None:
    """Wait for the device (a CPU runs synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); all ``values[0]`` for one value, NaN for none."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def median_ms(
    fn: Callable[[], object],
    device: torch.device,
    reps: int = 10,
    warmup: int = 3,
    before: Callable[[], object] | None = None,
) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, perf_counter on a CPU); ``before``
    runs ahead of every call, untimed (fresh inputs)."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def do_bench_ms(fn: Callable[[], object], rep: int = 200, return_mode: str = "median") -> float:
    """Milliseconds of ``fn`` by ``triton.testing.do_bench`` (CUDA events, after warm-up):
    the median of its repetitions, or their mean."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode=return_mode))


def graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile + warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times)


def matmul_tflops(
    device: torch.device, dtype: torch.dtype, batch: int = 4, n: int = 8192, timer: Timer | None = None
) -> float:
    """Measured dense (batch x n x n) matmul rate on random data: the ceiling for the NS floors.
    ``timer``: median_ms on ``device`` unless given."""
    if device.type == "cpu":
        dtype = torch.float32  # the CPU's half matmul is no ceiling worth quoting
    a = torch.randn(batch, n, n, device=device).to(dtype)
    b = torch.randn(batch, n, n, device=device).to(dtype)
    ms = (timer or (lambda fn: median_ms(fn, device)))(lambda: torch.bmm(a, b))
    return 2 * batch * n**3 / (ms * 1e-3) / 1e12


def copy_gbps(device: torch.device, numel: int = 1 << 28) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second); the default
    copies 1 GiB of fp32."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * numel * 4 / (ms * 1e-3) / 1e9
