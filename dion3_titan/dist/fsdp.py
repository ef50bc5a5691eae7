"""FSDP2 under compressed sync: gradients reduced within each replica only.

``replicate_sync = "compressed"`` needs every replica's own gradient in ``param.grad``: FSDP2
reduce-scatters it over the replica's shards, and does not all-reduce it across the replicas
(the optimizer agrees on the selected momentum rows instead). FSDP2's public
``set_requires_all_reduce(False)`` is not that switch: it keeps the reduce-scattered gradient in
FSDP's own buffer for a later all-reduce (gradient accumulation) and leaves ``param.grad`` unset.
So ``reduce_within_replicas`` gives each HSDP parameter group the mesh description of plain FSDP
over its shard dim (its placements, and so its DTensors and checkpoints, stay HSDP's) and scales
the reduction so that each replica's gradient is a full-scale estimate: the mean over replicas
is then the gradient FSDP2 would have produced with the all-reduce.

FSDP2 keeps the mesh description per parameter group in attributes it does not document
(``FSDPParamGroup.mesh_info``); tests/test_dist_replicas.py checks the result against native
HSDP, so a torch release that moves them fails there.
"""

import copy

import torch.nn as nn


def reduce_within_replicas(module: nn.Module) -> int:
    """Make every FSDP2 submodule of ``module`` (HSDP: a 2-D mesh of replicas x shards) reduce
    gradients over its shard dim only. Returns the number of parameter groups changed (0 when
    the module has no HSDP groups). Idempotent; call after ``fully_shard`` and before the
    first backward."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    changed = 0
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        for group in sub._get_fsdp_state()._fsdp_param_groups:
            info = group.mesh_info
            if not isinstance(info, HSDPMeshInfo):
                continue
            replicas = info.replicate_mesh_size
            within = copy.copy(info)
            within.__class__ = FSDPMeshInfo  # the same shard group, no replicate all-reduce
            if group.post_forward_mesh_info is info:
                group.post_forward_mesh_info = within
            group.mesh_info = within
            # An explicit divide factor makes FSDP2 sum across replicas (its all-reduce is a
            # SUM then), so each replica's share is 1/R of the synced gradient: scale it back
            # to full. Without one FSDP2 averages, within a replica as across them.
            if group.gradient_divide_factor is not None:
                group.gradient_divide_factor = group.gradient_divide_factor / replicas
            changed += 1
    return changed
