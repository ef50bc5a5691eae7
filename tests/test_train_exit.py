"""`python -m dion3_titan.train` leaves a finished CPU run by os._exit once its process group is
gone (gloo's threads have aborted finished ranks in C++ teardown), after flushing its logs."""

import logging
import os

import pytest
import torch
import torch.distributed as dist

from dion3_titan.train import leave_after_teardown


class _Exited(Exception):
    pass


def _record(calls: list, monkeypatch) -> None:
    """logging.shutdown and os._exit record their calls (os._exit then stops the caller)."""

    def exit_(code: int) -> None:
        calls.append(("exit", code))
        raise _Exited

    monkeypatch.setattr(logging, "shutdown", lambda: calls.append(("logging.shutdown",)))
    monkeypatch.setattr(os, "_exit", exit_)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the CPU (gloo) path")
def test_a_finished_cpu_run_leaves_by_os_exit_after_flushing(monkeypatch):
    calls: list = []
    _record(calls, monkeypatch)
    with pytest.raises(_Exited):
        leave_after_teardown()
    assert calls == [("logging.shutdown",), ("exit", 0)]


def test_a_run_whose_group_is_up_leaves_as_usual(monkeypatch, tmp_path):
    calls: list = []
    _record(calls, monkeypatch)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        leave_after_teardown()
    finally:
        dist.destroy_process_group()
    assert calls == []
