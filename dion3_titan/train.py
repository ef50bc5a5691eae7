"""`python -m dion3_titan.train` (under torchrun): torchtitan's own trainer with our optimizers,
through the adapter of the installed torchtitan generation, chosen here at start:

- torchtitan 0.2.x: `--job.config_file X.toml` (titan02/train.py);
- torchtitan 0.3: `--module dion3_titan.titan03.recipes --config <name>` (titan03/train.py).
"""

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


if __name__ == "__main__":
    main()
