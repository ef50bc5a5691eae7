"""`python -m dion3_titan.train` (under torchrun): torchtitan's own trainer with our optimizers,
through the adapter of the installed torchtitan generation, chosen here at start:

- torchtitan 0.2.x: `--job.config_file X.toml` (titan02/train.py);
- torchtitan 0.3: `--module dion3_titan.titan03.recipes --config <name>` (titan03/train.py).
"""

import logging
import os
import sys
from typing import Any


def titan_generation() -> tuple[int, int]:
    """(major, minor) of the installed torchtitan, read without importing it."""
    from importlib.metadata import version

    major, minor = version("torchtitan").split(".")[:2]
    return int(major), int(minor)


def main(trainer_class: type[Any] | None = None) -> None:
    """The installed generation's `main`; ``trainer_class`` (a Trainer subclass) is 0.2's."""
    _release_graphs_before_teardown()
    if titan_generation() >= (0, 3):
        from dion3_titan.titan03.train import main as main_03

        main_03()
        return
    from dion3_titan.titan02.train import main as main_02

    main_02(trainer_class)


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


def leave_after_teardown() -> None:
    """Ends a finished run on CPU ranks (gloo) without C++ static destructors: gloo's background
    threads have aborted a rank that had trained and destroyed its group ("terminate called
    without an active exception"), and torchrun then reports the run as failed. Logging and the
    standard streams are flushed first. A run with an accelerator, or whose group is still up,
    leaves as usual."""
    import torch
    import torch.distributed as dist

    if torch.accelerator.is_available() or (dist.is_available() and dist.is_initialized()):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    leave_after_teardown()
