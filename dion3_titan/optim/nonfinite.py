"""The ``nonfinite`` policy: what a step does with a NaN/inf gradient or Newton-Schulz result.

A step never applies a non-finite gradient, eager or replayed from a CUDA graph, and decides
so on the device. ``check`` reduces the gradients to one flag ``ok`` (1.0 when every gradient
of every rank is finite, else 0.0); every state write of the step is gated by it, so with
ok = 0 parameters and state keep their bits:

- a gradient enters the momentum as ``where(ok, g, -0.0)`` (adding -0.0 is the identity for
  every value, signed zeros included);
- the learning rate becomes ``lr * ok``: the decay factor 1 - lr wd is then exactly 1 and the
  update subtracts a zero (the weight keeps its value; only a weight of exactly -0.0 in an
  updated row could come back as +0.0);
- a multiplicative factor (the momentum decay mu) becomes ``where(ok, mu, 1)``;
- small state written by a scatter (NorMuon's second moment) keeps its old value;
- AdamW runs torch's fused kernel with ``found_inf = 1 - ok``: it returns early, and its step
  counter is incremented and decremented back.

The host learns the outcome afterwards: ``issued`` marks the step as queued and ``resolve``
reads its flag (an eager step at its end, a replayed step at the next ``step()`` or metrics
read), then counts the skipped step ("skip") or raises FloatingPointError naming the
parameters ("raise"). Both paths run the same device code.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from dion3_titan.kernels.backend import Backend
from dion3_titan.optim.orthogonalize import NSSettings, nonfinite_matrices, repair_nonfinite

POLICIES = ("raise", "skip")


class NSBatch(NamedTuple):
    """One batch given to ``orthogonalize`` and its result."""

    x: torch.Tensor
    out: torch.Tensor
    settings: NSSettings
    backend: Backend
    tall: bool | None = None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class NonfiniteGuard:
    """Owns the ``nonfinite`` policy of one optimizer: the step's ``ok`` flag, the gated
    factors the update stages use, the Newton-Schulz result check, and the counters."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"nonfinite={policy!r}: allowed values are {POLICIES}")
        self.policy = policy
        self._skipped = 0
        self._ns_bad: torch.Tensor | None = None  # device counter of non-finite NS results
        self.ok: torch.Tensor | None = None  # float 0/1 device scalar of the step being built
        self._ok_bool: torch.Tensor | None = None
        self._flags: torch.Tensor | None = None  # [ok, finite per gradient] on the device
        self._names: list[str] = []
        self._host: list[float] | None = None  # ``_flags`` already read for the step in flight
        self._pending = False
        self._event: torch.cuda.Event | None = None
        self._read_stream: torch.cuda.Stream | None = None

    # ----------------------------------------------------------------- device side (capturable)
    def check(self, named_grads: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> None:
        """Compute this step's ``ok`` from the local gradients: one multi-tensor reduction and,
        in a distributed run, one all-reduce of the flag so every rank decides alike."""
        grads = [g for _, g in named_grads]
        if grads:
            # max |g| per tensor: finite exactly when every entry is (NaN propagates)
            finite = torch.stack(torch._foreach_norm(grads, ord=float("inf"))).isfinite().float()
            ok = finite.min().reshape(1)
        else:
            finite = torch.zeros(0, device=device)
            ok = torch.ones(1, device=device)
        if _distributed():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        self._flags = torch.cat([ok, finite])
        self.ok = self._flags[0]
        self._ok_bool = self.ok > 0
        self._names = [name for name, _ in named_grads]
        self._host = None

    def masked(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient when ``ok``, else -0.0 everywhere (an exact no-op to add)."""
        return torch.where(self._ok_bool, grad, -0.0)

    def accumulate(self, targets: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """targets += grads when ``ok`` (bit for bit unchanged otherwise). One tensor at a time,
        so the masked copy never holds more than one gradient."""
        for t, g in zip(targets, grads):
            t.add_(self.masked(g))

    def scale(self, lr: torch.Tensor) -> torch.Tensor:
        """A learning rate that is 0 when not ``ok``."""
        return lr * self.ok

    def factor(self, value: float) -> torch.Tensor:
        """A multiplicative factor that is 1 when not ``ok``."""
        return torch.where(self._ok_bool, value, 1.0)

    def keep(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``new`` when ``ok``, else ``old`` (for small state written by a scatter)."""
        return torch.where(self._ok_bool, new, old)

    def found_inf(self) -> torch.Tensor:
        """torch's fused-AdamW skip flag: 1.0 when not ``ok``."""
        return 1.0 - self.ok

    def orthogonalized(
        self, batches: Sequence[NSBatch], sync_check: bool, void_in_kernel: Sequence[bool] = ()
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The batches' results with no non-finite matrix, and which matrices were not finite
        (counted). With ``sync_check`` (eager steps: one host read for every batch, and the
        gradient flag read with it) they are recomputed (``repair_nonfinite``); without it
        (captured steps) they become zero, so that matrix's update subtracts nothing — except
        where ``void_in_kernel`` says the update kernel zeroes them itself (the caller then
        passes it the returned flags)."""
        bads = [nonfinite_matrices(b.out) for b in batches]
        for bad in bads:
            self._count_ns(bad)
        if not sync_check:
            voided = list(void_in_kernel) + [False] * (len(batches) - len(void_in_kernel))
            zeroed = [
                b.out if in_kernel else torch.where(bad[:, None, None], torch.zeros_like(b.out), b.out)
                for b, bad, in_kernel in zip(batches, bads, voided)
            ]
            return zeroed, bads
        if not bads:
            return [], []
        anys = torch.stack([bad.any() for bad in bads]).float()
        if self._flags is not None and self._host is None:  # this step's gradient flag, same read
            values = torch.cat([self._flags, anys]).tolist()
            self._host, any_bad = values[: len(self._flags)], values[len(self._flags) :]
        else:
            any_bad = anys.tolist()
        outs = [
            repair_nonfinite(b.x, b.out, bad, b.settings, b.backend, b.tall) if flag else b.out
            for b, bad, flag in zip(batches, bads, any_bad)
        ]
        return outs, bads

    def _count_ns(self, bad: torch.Tensor) -> None:
        if bad.numel():
            if self._ns_bad is None:
                self._ns_bad = torch.zeros((), dtype=torch.int64, device=bad.device)
            self._ns_bad += bad.sum()

    # ----------------------------------------------------------------- host side
    def issued(self) -> None:
        """The step whose ``check`` ran last is queued: its flag is to be resolved."""
        self._pending = True
        self._event = None
        if self._host is None and self._flags is not None and self._flags.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def fetch(self) -> None:
        """Read a pending flag now (its device memory is about to be freed); ``resolve`` acts
        on it later."""
        if self._pending and self._host is None:
            self._host = self._read()

    def _read(self) -> list[float]:
        flags = self._flags
        if self._event is None:
            return flags.tolist()
        # Wait for the step itself, not for the work queued after it (the next forward and
        # backward): read on a stream that waits on the step's event only.
        if self._read_stream is None:
            self._read_stream = torch.cuda.Stream(device=flags.device)
        self._read_stream.wait_event(self._event)
        with torch.cuda.stream(self._read_stream):
            return flags.tolist()

    def resolve(self, undo: Callable[[], None] | None = None) -> None:
        """Act on the flag of the last issued step, if not done yet. A skipped step is counted
        ("skip"), or FloatingPointError names the parameters ("raise"); ``undo`` first rolls
        back what the host advanced during that step (selection seeds, step counters). In a
        distributed run every rank gets here at the same step (the flag is global)."""
        if not self._pending:
            return
        self._pending = False
        host = self._host if self._host is not None else self._read()
        self._host, self._event = None, None
        if host[0] == 1.0:
            return
        if undo is not None:
            undo()
        if self.policy == "skip":
            self._skipped += 1
            return
        bad = [name for name, finite in zip(self._names, host[1:]) if finite != 1.0]
        if _distributed():
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (dist.get_rank(), bad))
            bad = [f"{name} (rank {r})" for r, names in everyone for name in names]
        raise FloatingPointError(
            f"Dion3: non-finite gradient in {bad[:8]}{' ...' if len(bad) > 8 else ''} "
            "(set [optimizer] nonfinite = 'skip' to skip such steps)"
        )

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (reads a pending flag: may synchronize)."""
        self.resolve()
        return self._skipped

    @property
    def ns_events(self) -> int:
        """Matrices whose Newton-Schulz result was not finite so far. Synchronizes."""
        return 0 if self._ns_bad is None else int(self._ns_bad)
