"""Ranks of a benchmark under torchrun: rank, world, rank-0 logging, the process group and
the reductions a timed step needs (one process: no group, identity reductions)."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def log(msg: str) -> None:
    if rank() == 0:
        print(msg, flush=True)


def init_distributed(device_kind: str) -> tuple[torch.device, object]:
    """(device, FSDP mesh or None). Under torchrun with WORLD_SIZE > 1: NCCL on GPUs (one per
    LOCAL_RANK), gloo on CPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world <= 1:
        return device, None
    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=180)  # a rank that failed alone stops the job, not hangs it
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        dist.init_process_group("gloo", timeout=timeout)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    return device, mesh


def reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Elementwise maximum over ranks."""
    if not dist.is_initialized() or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
            torch.cuda.synchronize(device)
        else:
            dist.barrier()


def finish(device: torch.device) -> None:
    """End a distributed benchmark: wait for every rank, destroy the process group and leave
    without running C++ static destructors, where gloo's background threads have been seen to
    abort a finished rank ("terminate called without an active exception"). One process: returns."""
    if not dist.is_initialized():
        return
    barrier(device)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
