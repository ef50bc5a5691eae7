"""Host time of a replayed (CUDA-graph) optimizer step, piece by piece, on the Llama shapes of
scripts/bench_step.py: the whole ``step()``, then each thing it does before and at the launch
(the re-capture check, the gradient-address check, the lr/weight-decay refresh, and
``CUDAGraph.replay()``). Each is timed with perf_counter on an idle device, 30 times.

    python scripts/bench_host_time.py --model 7b --layers 8      # one GPU
"""

import argparse
import statistics
import sys
import time

import torch

from benchmarks.llama import GradFiller, build_model
from benchmarks.ranks import init_distributed
from benchmarks.step import model_shape, parse_args
from benchmarks.step_configs import GRAPH_WARMUP, BenchConfig
from benchmarks.step_runners import graphed_optimizer_class, make_runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="7b")
    p.add_argument("--layers", default="8")
    p.add_argument("--fractions", default="1,0.25")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (it times CUDA-graph replays)")
    args = parse_args(["--model", a.model, "--layers", a.layers])
    device, mesh = init_distributed("cuda")
    _, shape, _ = model_shape(args)
    graph_cls, note = graphed_optimizer_class()
    if graph_cls is None:
        sys.exit(note)
    print(f"{torch.cuda.get_device_name(device)}, {a.model} shapes, {a.layers} layers; microseconds")
    for fraction in (float(f) for f in a.fractions.split(",")):
        model = build_model(shape, device, mesh, 0)
        grads = GradFiller(model, device, 1)
        options = {
            "flavor": "muon",
            "weight_decay": 0.01,
            "fraction": fraction,
            "ns_algorithm": "gram",
            "backend": "auto",
        }
        runner = make_runner(BenchConfig("x", "x", "dion3", options, graph=True), model, device, graph_cls)
        graphed = runner.step.__self__
        for _ in range(GRAPH_WARMUP + 2):  # eager warm-up, capture, one replay
            grads.fill()
            runner.step()
        parts = {
            "step()": runner.step,
            "re-capture check": graphed.signature,
            "gradient addresses": graphed.refresh_grads,
            "lr / weight decay": graphed.optimizer.load_hyperparameters,
            "CUDAGraph.replay()": graphed.graph.replay,
        }
        for name, fn in parts.items():
            times = []
            for _ in range(a.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            print(
                f"f={fraction:g}  {name:20s} median {statistics.median(times):8.1f}  min {min(times):8.1f}", flush=True
            )
        runner.release()
        del runner, graphed, model, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
