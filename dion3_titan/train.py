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
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
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
    _initialize_router_bias()
    _normalize_pipeline_loss_before_backward()
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


def _normalize_pipeline_loss_before_backward() -> None:
    """torchtitan 0.2.2's pipeline schedule backpropagates each microbatch's summed loss and
    divides by the step's token count only the loss it logs (pytorch/torchtitan#2972), so with
    pipeline parallelism every gradient, and `grad_norm`, is `global_valid_tokens` times what it
    is without (and `max_norm` clips nearly every step). Divide inside the schedule's loss, as
    the non-PP path divides before backward; the logged loss stays the same."""
    from torchtitan.train import Trainer

    step = Trainer.forward_backward_step
    if getattr(step, "_dion3", False):
        return

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if not self.parallel_dims.pp_enabled:
            return step(self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        schedule = self.pp_schedule
        loss_sum = schedule._loss_fn

        def loss_per_token(pred, target, **kwargs):
            return loss_sum(pred, target, **kwargs) / global_valid_tokens

        schedule._loss_fn = loss_per_token
        try:
            loss = step(self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        finally:
            schedule._loss_fn = loss_sum
        # torchtitan divides the collected (now per-token) losses by the token count again
        return loss * global_valid_tokens if self.pp_has_last_stage else loss

    forward_backward_step._dion3 = True  # type: ignore[attr-defined]
    Trainer.forward_backward_step = forward_backward_step  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
