"""`python -m dion3_titan.train --job.config_file X.toml` (under torchrun): torchtitan's own
trainer and `main`, with the dion3 plugin registered, plus the CPU/gloo shims when the machine
has no accelerator. With torchtitan 0.3 installed the same command takes 0.3's
`--module dion3_titan.titan03.recipes --config <name>` and runs titan03/train.py instead: the
adapter of the installed generation is chosen here, at start."""

import sys
from typing import Any

import torch


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def check_optimizer_config(args: list[str]) -> None:
    """Parse the job config as torchtitan will and validate the Dion3 keys now, in seconds,
    instead of when torchtitan builds the optimizer (after the model is built and sharded)."""
    from torchtitan.config import ConfigManager

    from dion3_titan.plugin import NAMES, dion3_options

    cfg = ConfigManager().parse_args(args).optimizer
    if cfg.name in NAMES:
        dion3_options(cfg)  # ValueError naming the key and its allowed values


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
    check_optimizer_config(sys.argv[1:])
    _release_graphs_before_teardown()
    _initialize_router_bias()
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


def _initialize_router_bias() -> None:
    """torchtitan 0.2.2's MoE router initializes its gate weight but not the gate bias
    (`gate_bias = true`, as in gpt_oss), which keeps whatever memory it was given -- NaN at
    times, and then every loss is NaN. Zero it after the weight's own initialization."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    init = TokenChoiceTopKRouter.init_weights
    if getattr(init, "_dion3", False):
        return

    def init_weights(self, init_std: float) -> None:
        init(self, init_std)
        if self.gate.bias is not None:
            torch.nn.init.zeros_(self.gate.bias)

    init_weights._dion3 = True  # type: ignore[attr-defined]
    TokenChoiceTopKRouter.init_weights = init_weights  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
