"""Real processes for the tests: a function on N ranks joined by a gloo process group (CPU),
several such functions in turn on one set of ranks (one process start-up for all), and the
torchrun command and environment of the tests that launch a script."""

import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *target: str, rank0_logs: bool = False) -> list[str]:
    """The command that starts ``nproc`` ranks of ``target`` (a script, or ``-m module``, then its
    arguments) under torchrun, meeting on a free port; ``rank0_logs``: only rank 0's console."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
    ]
    return [*cmd, *(["--local-ranks-filter", "0"] if rank0_logs else []), *target]


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH (a subprocess imports the code under
    test, installed or not), plus ``extra``."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def _entry(rank: int, world: int, port: int, fn, args, errors, backend: str) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    # The ranks share the machine's cores: one thread each. (OMP_NUM_THREADS would come too late,
    # torch is loaded by now; a rank's tiny ops run many times slower with its threads contending.)
    torch.set_num_threads(1)
    if backend == "nccl":
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
        mp.start_processes(
            _entry, args=(world, free_port(), fn, args, errors, backend), nprocs=world, join=True, start_method="spawn"
        )
    except Exception as exc:
        detail = errors.get() if not errors.empty() else ""
        raise AssertionError(f"distributed run failed:\n{detail}") from exc


def _each(rank: int, world: int, jobs: list[tuple[str, Callable, tuple]], folder: str) -> None:
    for name, fn, args in jobs:
        try:
            fn(rank, world, *args)
        except BaseException as exc:
            raise RuntimeError(f"check {name!r} failed on rank {rank}") from exc
        dist.barrier()  # every rank is done with it: the next one's collectives start afresh
        if rank == 0:
            (Path(folder) / f"{name}.done").touch()


def spawn_each(world: int, jobs: dict[str, tuple[Callable, tuple]], folder: Path) -> dict[str, str | None]:
    """Run each job's ``fn(rank, world, *args)`` in turn on one set of ``world`` spawned gloo
    ranks (for tests whose checks are cheap next to starting the processes). Returns, per job
    name, None once every rank finished it, else why not: its own failure (named), or the
    earlier job's failure that stopped the ranks before it."""
    folder.mkdir(parents=True, exist_ok=True)
    failure = ""
    try:
        spawn(world, _each, [(name, fn, args) for name, (fn, args) in jobs.items()], str(folder))
    except AssertionError as exc:
        failure = str(exc)
    status: dict[str, str | None] = {}
    stopped_at = None
    for name in jobs:
        if (folder / f"{name}.done").exists():
            status[name] = None
        elif stopped_at is None:
            stopped_at = name
            status[name] = f"check {name!r} failed:\n{failure}"
        else:
            status[name] = f"check {name!r} did not run: the ranks stopped at {stopped_at!r}:\n{failure}"
    return status
