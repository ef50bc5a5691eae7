"""Where the host time of an eager optimizer step goes, on the Llama shapes of
scripts/bench_step.py: the step's host time (perf_counter around ``step()`` on an idle device,
no sync of ours inside) and the time until the device finishes it, for each layer count given
(the row engine launches per shape group, so the launches do not grow with layers: a host time
that does grow is the host waiting for the device's launch queue); the host time of each stage
(perf_counter wrappers); the device launches (torch.profiler, by kind); and a cProfile.

    python scripts/profile_host.py --model 7b --layers 1,8 --flavor normuon --fraction 0.25   # one GPU
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

LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaLaunchCooperativeKernel",
)


def host_times(step, grads: GradFiller, repeats: int) -> tuple[list[float], list[float]]:
    """(host ms of each step, ms from the host's return to the device's end of the step)."""
    host, tail = [], []
    for _ in range(repeats):
        grads.fill()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        tail.append((time.perf_counter() - t1) * 1e3)
    return host, tail


STAGES = {  # (module, qualified name) of what one eager step calls, timed on the host
    "dion3_titan.optim.nonfinite": [
        "NonfiniteGuard.check",
        "NonfiniteGuard.resolve",
        "NonfiniteGuard.orthogonalized",
        "NonfiniteGuard.publish",
    ],
    "dion3_titan.optim.dion3": [
        "Dion3._adamw_step",
        "Dion3._accumulate",
        "Dion3._orthogonalize",
        "Dion3._checked",
        "Dion3._group_step",
        "Dion3._step_factors",
        "Dion3.load_hyperparameters",
    ],
    "dion3_titan.optim.selection": ["RowSelector.scores", "RowSelector.select", "RowSelector.seed"],
    "dion3_titan.optim.stages_engine": ["RowEngineStages.pack", "RowEngineStages.normalize", "RowEngineStages.update"],
    "dion3_titan.optim.observe": ["Observer.record"],
}


def timed_stages() -> dict[str, list[float]]:
    """Wrap each STAGES method with a perf_counter timer; returns name -> [seconds, calls]."""
    import importlib

    totals: dict[str, list[float]] = {}
    for module, names in STAGES.items():
        mod = importlib.import_module(module)
        for qual in names:
            cls_name, meth = qual.split(".")
            cls = getattr(mod, cls_name, None)
            fn = getattr(cls, meth, None) if cls is not None else None
            if fn is None:
                continue
            totals[qual] = [0.0, 0]

            def wrapper(*args, _fn=fn, _acc=totals[qual], **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    _acc[0] += time.perf_counter() - t0
                    _acc[1] += 1

            setattr(cls, meth, wrapper)
    return totals


def launch_counts(step, grads: GradFiller) -> Counter:
    grads.fill()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
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


def build(model_name: str, layers: str, options: dict, device, mesh, given_norm: bool = False) -> tuple:
    """(step, gradient filler) of an eager Dion3 on the model's shapes, warmed up (kernels
    compiled, tables built). ``given_norm``: each step is handed the gradients' total norm
    first, as torchtitan's gradient clipping does (dion3_titan/clipping.py), so it makes no
    finiteness pass of its own."""
    _, shape, _ = model_shape(parse_args(["--model", model_name, "--layers", layers]))
    model = build_model(shape, device, mesh, 0)
    grads = GradFiller(model, device, 1)
    step = make_runner(BenchConfig("x", "x", "dion3", options), model, device, None).step
    if given_norm:
        opt = step.__self__
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.locals]))

        def step() -> None:
            opt.use_gradient_norm(norm)
            opt.step()

    host_times(step, grads, 4)
    return step, grads


def ab_launch_cache(a, options: dict, device, mesh) -> None:
    """Host ms per step with the launch cache on and off, interleaved in one process (the host's
    own speed drifts between calls more than the difference)."""
    from dion3_titan.kernels import launch

    step, grads = build(a.model, a.layers.split(",")[-1], options, device, mesh, a.given_norm)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(a.ab_launch_cache):
        for on in (True, False):
            launch.ENABLED = on
            times[on] += host_times(step, grads, 5)[0]
    launch.ENABLED = True
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"launch cache A/B ({a.ab_launch_cache} rounds of 5 steps): host ms median on {on:.2f}, off {off:.2f}")
    del step, grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="7b")
    p.add_argument("--layers", default="1,8", help="comma-separated layer counts (the last is profiled)")
    p.add_argument("--flavor", default="normuon")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--given-norm", action="store_true", help="hand each step the gradient norm (as under torchtitan)")
    p.add_argument(
        "--ab-launch-cache",
        type=int,
        default=0,
        help="then this many rounds of steps with kernels/launch.py's cache on and off, interleaved",
    )
    p.add_argument("--dump", default="", help="also write the cProfile's stats to this file (pstats)")
    p.add_argument(
        "--triton-min-n", type=int, default=0, help="override dispatch.TRITON_MIN_N (an A/B of the torch/Triton split)"
    )
    p.add_argument(
        "--one-stream", action="store_true", help="ns_overlap = false: every shape group on the step's stream"
    )
    a = p.parse_args()
    if a.triton_min_n:
        from dion3_titan.kernels import dispatch

        dispatch.TRITON_MIN_N = a.triton_min_n
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (it times host time against an asynchronous device)")
    device, mesh = init_distributed("cuda")
    options = {"flavor": a.flavor, "weight_decay": 0.01, "fraction": a.fraction, "ns_algorithm": "gram"}
    if a.one_stream:
        options["ns_overlap"] = False
    print(
        f"{torch.cuda.get_device_name(device)}, {a.model} shapes, {a.flavor} f={a.fraction:g}"
        + (", gradient norm given" if a.given_norm else ", own finiteness pass")
    )
    layer_counts = a.layers.split(",")
    for layers in layer_counts:
        step, grads = build(a.model, layers, options, device, mesh, a.given_norm)
        host, tail = host_times(step, grads, a.repeats)
        print(
            f"{layers} layers: eager host ms median {statistics.median(host):.2f} (min {min(host):.2f}, max "
            f"{max(host):.2f}); the device is busy {statistics.median(tail):.2f} ms after the return",
            flush=True,
        )
        del step, grads
        torch.cuda.empty_cache()

    if a.ab_launch_cache:
        ab_launch_cache(a, options, device, mesh)
    totals = timed_stages()
    step, grads = build(a.model, layer_counts[-1], options, device, mesh, a.given_norm)
    for v in totals.values():
        v[0], v[1] = 0.0, 0
    host, _ = host_times(step, grads, a.repeats)
    print(f"host ms per step by stage ({layer_counts[-1]} layers, step median {statistics.median(host):.2f}):")
    for qual, (sec, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"  {qual:36s} {sec * 1e3 / a.repeats:7.2f} ms  {calls / a.repeats:5.1f} calls")

    counts, kernels = launch_counts(step, grads)
    print("launch API calls per step:", dict(counts), "total", sum(counts.values()))
    print("device kernels per step, by name:")
    for name, n in kernels.most_common(40):
        print(f"  {n:5d}  {name}")
    prof = cProfile.Profile()
    grads.fill()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(5):
        step()
    prof.disable()
    torch.cuda.synchronize()
    if a.dump:
        prof.dump_stats(a.dump)
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
        print(f"cProfile of 5 steps, by {key}:\n" + buf.getvalue())


if __name__ == "__main__":
    main()
