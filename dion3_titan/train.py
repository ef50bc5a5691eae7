"""`python -m dion3_titan.train --job.config_file X.toml` (under torchrun): torchtitan's own
trainer and `main`, with the dion3 plugin registered, plus the CPU/gloo shims when the machine
has no accelerator. With torchtitan 0.3 installed the same command takes 0.3's
`--module dion3_titan.titan03.recipes --config <name>` and runs titan03/train.py instead: the
adapter of the installed generation is chosen here, at start."""

import json
import os
import sys
import time
from typing import Any

import torch


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def check_config_or_exit(args: list[str]) -> None:
    """Check the job config before torchtitan builds anything (dion3_titan.check_config). A bad
    one stops every rank (each checks the same config) with exit code 2 and no traceback; rank 0
    prints the one-line reason, which torchrun's failure table also shows as the root cause."""
    if {"-h", "--help"} & set(args):
        return
    from dion3_titan.check_config import ConfigError, parse_job_config

    try:
        parse_job_config(args)
    except ConfigError as e:
        message = str(e)
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)
        _write_torchelastic_error_file(message)
        sys.exit(2)


def _write_torchelastic_error_file(message: str) -> None:
    """torchrun reads a failed worker's error file (in torchelastic's JSON format) into the
    "traceback" row of its failure table; without one that row is a link to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {
        "message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
    }
    with open(path, "w") as f:
        json.dump(record, f)


def titan_generation() -> tuple[int, int]:
    """(major, minor) of the installed torchtitan, read without importing it."""
    from importlib.metadata import version

    major, minor = version("torchtitan").split(".")[:2]
    return int(major), int(minor)


def main(trainer_class: type[Any] | None = None) -> None:
    """Runs torchtitan's `main` with `trainer_class` (default: torchtitan's Trainer; 0.2 only)."""
    if titan_generation() >= (0, 3):
        from dion3_titan.titan03.train import main as main_03

        _release_graphs_before_teardown()
        main_03()
        return
    # Shims first: they rebind torchtitan's device globals before the trainer reads them.
    if not has_accelerator():
        from dion3_titan import cpu_shims

        cpu_shims.apply()

    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    from dion3_titan import plugin

    # Registered even when the TOML does not name dion3_titan.job_config, so the offline
    # dataset works from any config (naming "dion3" without it stops with a message saying so).
    plugin.register()
    check_config_or_exit(sys.argv[1:])
    _release_graphs_before_teardown()
    plugin.fix_torchtitan()
    titan_main(trainer_class or Trainer)


def _release_graphs_before_teardown() -> None:
    """torchtitan's main destroys the process group at exit; a captured optimizer step holds
    NCCL work on it, so free captured steps first (else teardown can hang)."""
    import torch.distributed as dist

    from dion3_titan.optim.cuda_graph import release_all

    destroy = dist.destroy_process_group
    if getattr(destroy, "_dion3", False):
        return

    def destroy_after_release(*args, **kwargs):
        release_all()
        return destroy(*args, **kwargs)

    destroy_after_release._dion3 = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_after_release


if __name__ == "__main__":
    main()
