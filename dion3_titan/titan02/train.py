"""torchtitan 0.2's `main`, run by `python -m dion3_titan.train --job.config_file X.toml` (under
torchrun): torchtitan's own trainer with the plugin registered (plugin.py), the job config
checked on every rank before anything is built (check_config.py), two torchtitan 0.2.2 defects
fixed, and the CPU/gloo shims when the machine has no accelerator."""

import json
import os
import sys
import time
from typing import Any

import torch


def check_config_or_exit(args: list[str]) -> None:
    """Check the job config before torchtitan builds anything (check_config.py). A bad one
    stops every rank (each checks the same config) with exit code 2 and no traceback; rank 0
    prints the one-line reason, which torchrun's failure table also shows as the root cause."""
    if {"-h", "--help"} & set(args):
        return
    from dion3_titan.titan02.check_config import ConfigError, parse_job_config

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


def main(trainer_class: type[Any] | None = None) -> None:
    """Runs torchtitan's `main` with `trainer_class` (default: torchtitan's Trainer)."""
    # Shims first: they rebind torchtitan's device globals before the trainer reads them.
    if not torch.accelerator.is_available():
        from dion3_titan.titan02 import cpu_shims

        cpu_shims.apply()

    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    from dion3_titan.titan02 import plugin

    # Registered even when the TOML does not name dion3_titan.job_config, so the offline
    # dataset works from any config (naming "dion3" without it stops with a message saying so).
    plugin.register()
    check_config_or_exit(sys.argv[1:])
    plugin.fix_torchtitan()
    titan_main(trainer_class or Trainer)
