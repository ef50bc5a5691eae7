"""The training process scripts/bench_train.py launches per run (benchmarks/train_throughput.py
says what it measures): what `python -m dion3_titan.train` runs, with the parent's llama3
arguments registered as a flavor and a Trainer subclass that only adds clocks, writing its
per-step record into the dump folder."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import RegionTimer

MODEL_ENV = "DION3_BENCH_MODEL"  # the child's llama3 arguments (JSON), from the parent
FLAVOR = "bench"  # the llama3 flavor name the child registers for them
RECORD = "bench_record.json"  # what the child writes into its dump folder


def register_flavor() -> None:
    """The parent's llama3 arguments as the flavor FLAVOR (torchtitan reads flavors from this dict)."""
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    llama3_args[FLAVOR] = TransformerModelArgs(**json.loads(os.environ[MODEL_ENV]))


class OptimizerTimer:
    """Wraps ``optimizers.step``: its device time by a RegionTimer (on a GPU, read after the
    step's closing sync, so the timer adds no sync of its own)."""

    def __init__(self, step, on_gpu: bool) -> None:
        self._step = step
        self._timer = RegionTimer(on_gpu)

    def __call__(self, *args, **kwargs):
        begin = self._timer.start()
        result = self._step(*args, **kwargs)
        self._timer.stop(begin)
        return result

    def last_ms(self) -> float:
        return self._timer.last_ms()


def peak_gb(on_gpu: bool) -> float:
    import resource

    if on_gpu:
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def compile_count() -> int:
    """torch.compile's compilations so far in this process: frames Dynamo compiled (recompiles
    included) and backward graphs Inductor compiled (lazily, at a graph's first backward)."""
    from torch._dynamo.utils import compilation_time_metrics as times

    return len(times.get("_compile.compile_inner", ())) + len(times.get("compile_fx.<locals>.bw_compiler", ()))


def timing_trainer() -> type:
    from torchtitan.train import Trainer

    class TimingTrainer(Trainer):
        """torchtitan's Trainer, unchanged but for the clocks (see the module docstring)."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self._on_gpu = self.device.type == "cuda"
            self._timer = OptimizerTimer(self.optimizers.step, self._on_gpu)
            self.optimizers.step = self._timer  # the trainer calls self.optimizers.step()
            self._pending: dict = {}
            log = self.metrics_processor.log

            def log_and_record(step: int, loss: float, *args: Any, **kwargs: Any) -> None:
                # before torchtitan's log, which resets the device's peak memory statistics
                self._pending = {"loss": float(loss), "peak_gb": peak_gb(self._on_gpu)}
                log(step, loss, *args, **kwargs)

            self.metrics_processor.log = log_and_record
            self._record = {
                "params": sum(p.numel() for m in self.model_parts for p in m.parameters()),
                "tokens_per_step": job_config.training.local_batch_size * job_config.training.seq_len,
                "compiled": bool(job_config.compile.enable),
                "cuda_graph": self._captures(),
                "cuda_graph_captured": False,  # set at the end of training
                "steps": [],
            }

        def _captures(self) -> bool:
            """Whether the optimizer step is replayed from a CUDA graph (torchtitan's own
            container, for AdamW, never captures)."""
            return bool(getattr(self.optimizers, "cuda_graph", False))

        def _sync(self) -> None:
            if self._on_gpu:
                torch.cuda.synchronize()

        def train_step(self, data_iterator) -> None:
            self._sync()
            t0 = time.perf_counter()
            super().train_step(data_iterator)
            self._sync()
            step_ms = (time.perf_counter() - t0) * 1e3
            entry = {"step": self.step, "step_ms": step_ms, "optimizer_ms": self._timer.last_ms(), **self._pending}
            entry["compiles"] = compile_count()
            self._record["steps"].append(entry)

        def train(self) -> None:
            super().train()
            # before main's teardown, which frees captured graphs
            self._record["cuda_graph_captured"] = bool(getattr(self.optimizers, "captured", False))
            if torch.distributed.get_rank() == 0:
                path = Path(self.job_config.job.dump_folder) / RECORD
                path.write_text(json.dumps(self._record))

    return TimingTrainer


if __name__ == "__main__":  # the training process the parent launches
    register_flavor()
    from dion3_titan.train import main as train_main

    train_main(timing_trainer())
    # The record is written and the process group destroyed; skipping the interpreter's own
    # teardown (torch, torchtitan, datasets) saves ~3 s per run on a small CPU.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
