"""Run a function on N real processes joined by a gloo process group (CPU)."""

import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, errors, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        sys.stdout.flush()
        os._exit(1)
    # Leave without running C++ static destructors: gloo's background threads have been seen to
    # abort a finished process there ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, fn, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks (gloo on CPU, or nccl with
    one GPU each); re-raise the first failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, errors, backend), nprocs=world, join=True, start_method="spawn")
    except Exception as exc:
        detail = errors.get() if not errors.empty() else ""
        raise AssertionError(f"distributed run failed:\n{detail}") from exc
