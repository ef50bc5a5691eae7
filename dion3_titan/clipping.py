"""torchtitan's gradient clipping, seen by our optimizers: one wrapper of torchtitan's
``clip_grad_norm_`` (``torchtitan.distributed.utils``, the same in 0.2 and 0.3), shared by both
adapters' containers.

The trainer clips every step, right before ``optimizers.step()``, and the total norm it
computes is already the same on every rank (``full_tensor`` of the DTensor norm over the data
and tensor parallel meshes, an all-reduce over pipeline stages and expert meshes). The wrapper
hands that norm to each container whose parameters it covers, so that their optimizers take
the step's non-finite flag from it (optim/nonfinite.py) instead of a pass over every gradient.
The clipped gradients are finite exactly when the norm is: a finite norm clips by a finite
factor of at most 1.

Two rules, both here:

- the norm is handed over only when ``max_norm > 0``. torchtitan has no switch that turns
  clipping off (it always computes the norm and clips); ``max_norm`` 0 multiplies every
  gradient by 0 and a negative one flips them, so a step there makes its own pass;
- a container under ``replicate_sync = "compressed"`` sees each replica's own gradients, so
  they are clipped by one replica-consistent norm (compressed.replica_norm), which is also the
  norm handed over: finite exactly when every replica's gradients are, on every rank.
"""

import inspect
import math
import weakref
from typing import Protocol

import torch

from dion3_titan.compressed import replica_norm


class NormReceiver(Protocol):
    def use_gradient_norm(self, norm: torch.Tensor) -> None:
        """This step's gradients, every one the receiver steps, have total norm ``norm``."""


# receiver -> (ids of its parameters, clip by the replica-consistent norm)
_receivers: "weakref.WeakKeyDictionary[NormReceiver, tuple[frozenset[int], bool]]" = weakref.WeakKeyDictionary()


def install(receiver: NormReceiver, params: list[torch.Tensor], replica_consistent: bool = False) -> None:
    """From now on, torchtitan's clipping of (at least) ``params`` hands its norm to
    ``receiver``; with ``replica_consistent`` it clips them by the replica-consistent norm."""
    _receivers[receiver] = (frozenset(id(p) for p in params), replica_consistent)
    _wrap_torchtitan_clip()


def _wrap_torchtitan_clip() -> None:
    import torchtitan.distributed.utils as dist_utils

    clip = dist_utils.clip_grad_norm_
    if getattr(clip, "_dion3", False):
        return
    signature = inspect.signature(clip)

    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        clipped = {id(p) for p in params}
        # every parameter a receiver steps must be in the norm, else the norm says nothing of it
        receivers = [(r, replica) for r, (ids, replica) in list(_receivers.items()) if ids <= clipped]
        bound = signature.bind(params, max_norm, *args, **kwargs)
        bound.apply_defaults()
        if any(replica for _, replica in receivers):
            bound.arguments["max_norm"] = math.inf  # each replica's own norm, nothing clipped yet
            norm = replica_norm(clip(*bound.args, **bound.kwargs), params, bound.arguments["norm_type"])
            _clip_per_mesh(params, max_norm, norm, bound.arguments.get("foreach"))
        else:
            norm = clip(*bound.args, **bound.kwargs)
        if isinstance(max_norm, (int, float)) and max_norm > 0:
            for receiver, _ in receivers:
                receiver.use_gradient_norm(norm)
        return norm

    clip_grad_norm_._dion3 = True  # type: ignore[attr-defined]
    dist_utils.clip_grad_norm_ = clip_grad_norm_


def _clip_per_mesh(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor, foreach: bool | None) -> None:
    """Scale the gradients of ``params`` by max_norm / norm (at most 1), one call per device
    mesh: a foreach op takes DTensors of one mesh only, and expert parallelism puts the experts
    on a mesh of their own (torchtitan clips them apart too)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=foreach)
