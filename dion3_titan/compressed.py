"""torchtitan glue for ``replicate_sync = "compressed"``, shared by both adapters.

Under compressed sync (paper Sec. 7) FSDP2 reduces gradients within each HSDP replica only
(dist/fsdp.py) and the optimizer agrees across replicas on the selected momentum rows. The
trainer's gradient clipping then sees each replica's own gradients, so its norm would differ
between replicas and so would the clip factor: torchtitan's ``clip_grad_norm_`` clips them by
one replica-consistent norm instead (``replica_norm``, applied by clipping.py for a container
installed with ``replica_consistent``), the root mean square over replicas of each replica's
gradient norm (each replica's gradient is a full-scale estimate of the synced one). By the
triangle inequality it is at least the norm of the synced gradient (the mean of the replicas'
gradients), and equal to it when the replicas' gradients agree: clipping is never weaker than
under gradient sync.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from dion3_titan.dist.fsdp import reduce_within_replicas
from dion3_titan.dist.replicas import replicate_dims


def prepare(model_parts: list[nn.Module]) -> None:
    """Turn FSDP2's all-reduce across replicas off for every model part. ValueError (one
    line) when the model is not HSDP."""
    if not sum(reduce_within_replicas(m) for m in model_parts):
        raise ValueError(
            "[optimizer] replicate_sync='compressed' needs HSDP (FSDP2 over a replicas x shards mesh: "
            "data_parallel_replicate_degree > 1 and data_parallel_shard_degree > 1); this model has no "
            "such FSDP2 module; use replicate_sync='gradients'"
        )


def replica_norm(norm: torch.Tensor, params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The p-norm mean over replicas of each replica's gradient norm ``norm`` (the largest for
    the inf-norm), over the replicate mesh dim of the first parameter that has one."""
    dims = next((replicate_dims(p.grad) for p in params if p.grad is not None and replicate_dims(p.grad)), [])
    if not dims:
        return norm
    some = next(p.grad for p in params if p.grad is not None and replicate_dims(p.grad))
    group = some.device_mesh.get_group(dims[0])
    if math.isinf(norm_type):
        out = norm.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out
    out = norm.double() ** norm_type
    dist.all_reduce(out, group=group)
    return ((out / dist.get_world_size(group)) ** (1.0 / norm_type)).to(norm.dtype)
