"""Where the host time of an eager optimizer step goes, on the Llama shapes of
scripts/bench_step.py: the step's host time (perf_counter around ``step()`` on an idle device,
no sync of ours inside), the device launches it makes (torch.profiler, by kind), and a
cProfile of the same steps (top functions by own time).

    python scripts/profile_host.py --model 7b --layers 8 --flavor normuon --fraction 0.25   # one GPU
"""

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import Counter

import torch

from benchmarks.llama import GradFiller, build_model
from benchmarks.ranks import init_distributed
from benchmarks.step import model_shape, parse_args
from benchmarks.step_configs import BenchConfig
from benchmarks.step_runners import make_runner

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
            "cudaMemsetAsync", "cudaLaunchCooperativeKernel")


def host_times(step, grads: GradFiller, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        grads.fill()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return out


def launch_counts(step, grads: GradFiller) -> Counter:
    grads.fill()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    counts: Counter = Counter()
    for ev in prof.key_averages():
        if ev.key in LAUNCHES:
            counts[ev.key] += ev.count
    kernels: Counter = Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name[:70]] += 1
    return counts, kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="7b")
    p.add_argument("--layers", default="8")
    p.add_argument("--flavor", default="normuon")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--top", type=int, default=45)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (it times host time against an asynchronous device)")
    args = parse_args(["--model", a.model, "--layers", a.layers])
    device, mesh = init_distributed("cuda")
    _, shape, _ = model_shape(args)
    model = build_model(shape, device, mesh, 0)
    grads = GradFiller(model, device, 1)
    options = {"flavor": a.flavor, "weight_decay": 0.01, "fraction": a.fraction, "ns_algorithm": "gram",
               "backend": "auto"}
    runner = make_runner(BenchConfig("x", "x", "dion3", options), model, device, None)
    host_times(runner.step, grads, 4)  # compile kernels, build tables
    times = host_times(runner.step, grads, a.repeats)
    print(f"{torch.cuda.get_device_name(device)}, {a.model} x {a.layers} layers, {a.flavor} f={a.fraction:g}")
    print(f"eager host ms: median {statistics.median(times):.2f}  min {min(times):.2f}  max {max(times):.2f}")
    counts, kernels = launch_counts(runner.step, grads)
    print("launch API calls per step:", dict(counts), "total", sum(counts.values()))
    print("device kernels per step, by name:")
    for name, n in kernels.most_common(40):
        print(f"  {n:5d}  {name}")
    prof = cProfile.Profile()
    grads.fill()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(5):
        runner.step()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
        print(f"cProfile of 5 steps, by {key}:\n" + buf.getvalue())


if __name__ == "__main__":
    main()
