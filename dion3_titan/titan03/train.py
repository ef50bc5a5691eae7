"""torchtitan 0.3's `main`, run by `python -m dion3_titan.train --module <config module>
--config <function>` (under torchrun): with the CPU/gloo shims when the machine has no
accelerator, the torch shim below, and the offline corpus registered as a dataset."""

import torch


def _torch_set_timeout() -> None:
    """torchtitan 0.3 lowers the process groups' timeouts after step 1 with
    `torch.distributed.set_timeout`, which torch releases before 2.14 lack; their private
    `_set_pg_timeout` does the same."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout


def _require_torch_for_titan03() -> None:
    """torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` at start-up;
    torch 2.11 lacks it (2.13 has it). Say so in one line instead of torchtitan's ImportError."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        raise SystemExit(
            f"torchtitan 0.3 needs a torch with torch.distributed.fsdp.DataParallelMeshDims (2.13 has it); "
            f"this is torch {torch.__version__}: upgrade torch, or use torchtitan 0.2.2"
        )


def main() -> None:
    _require_torch_for_titan03()
    if not torch.accelerator.is_available():
        from dion3_titan.titan03 import cpu_shims

        cpu_shims.apply()
    _torch_set_timeout()

    from torchtitan.train import main as titan_main

    from dion3_titan.data.titan_dataset import register_datasets

    register_datasets()
    titan_main()
