"""The ``nonfinite`` policy: what a step does with a NaN/inf gradient or Newton-Schulz result.

A step never applies a non-finite gradient, eager or replayed from a CUDA graph, and decides
so on the device. ``check`` makes one flag ``ok`` (1.0 when every gradient of every rank is
finite, else 0.0) from one of two sources:

- the gradients' total norm, when the step was given one (``use_gradient_norm``: torchtitan's
  gradient clipping computes it every step anyway, dion3_titan/clipping.py hands it over). A
  p-norm is finite exactly when every entry is, and a norm that overflows counts as non-finite
  (a step that large is not one to apply). No pass over the gradients and no all-reduce: the
  norm is already global (torchtitan reduces it over every mesh dim, pipeline stages included;
  under compressed sync over the replicas too), so every rank reads the same flag; whoever
  gives a norm must make it so, and make it cover every gradient the step reads;
- otherwise the optimizer's own pass: max |g| of every local gradient in one multi-tensor
  reduction, then one all-reduce (MIN) of the flag so every rank decides alike.

Every state write of the step is gated by ``ok``, so with ok = 0 parameters and state keep
their bits:

- a gradient enters the momentum as ``where(ok, g, -0.0)`` (adding -0.0 is the identity for
  every value, signed zeros included);
- the learning rate becomes ``lr * ok``: the decay factor 1 - lr wd is then exactly 1 and the
  update subtracts a zero (the weight keeps its value; only a weight of exactly -0.0 in an
  updated row could come back as +0.0);
- a multiplicative factor (the momentum decay mu) becomes ``where(ok, mu, 1)``;
- small state written by a scatter (NorMuon's second moment) keeps its old value;
- AdamW runs torch's fused kernel with ``found_inf = 1 - ok``: it returns early, and its step
  counter is incremented and decremented back.

A Newton-Schulz result that is not finite (fp16 overflow) is never applied either: that
matrix's update is zero for the step (the update kernel voids it, or the result is zeroed),
and ``ns_events`` counts it.

The host learns the outcome afterwards, without waiting inside a step: the step's last device
op copies its flags into pinned host memory (part of a captured step too), ``issued`` marks
the step as queued, and ``resolve`` reads the flags at the next ``step()`` (or a metrics
read), waiting for that step only, then counts the skipped step ("skip") or raises
FloatingPointError ("raise") naming the parameters (own pass: it has a flag per gradient) or
saying the step's gradient norm was not finite. Eager and replayed steps run the same device
code and the same host code. A given norm is copied into one device buffer that the step reads,
so a captured step reads each replay's norm; it serves the next step only (``issued`` clears it).
"""

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

POLICIES = ("raise", "skip")
SOURCES = ("gradient_norm", "own_pass")  # where a step's flag came from (``flag_sources``)


def nonfinite_matrices(out: torch.Tensor, row_sq: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) mask of the matrices in a batch holding a NaN or inf. ``row_sq`` (B, K): the
    batch's rows' float32 sums of squares, when already computed: their total is not finite
    exactly when an entry is not, for fp16 entries (65504² times any row length here stays far
    below float32's range); for wider ones (bf16, float32) a square's overflow to inf also
    counts, and a result that large is no orthogonalization either."""
    if row_sq is not None:
        return ~below_inf(row_sq.sum(-1))
    # max |x| per matrix in one reduction; NaN propagates through the max. Over both dims, not
    # a flattened view: a transposed result would be copied first.
    return ~below_inf(torch.linalg.vector_norm(out, ord=float("inf"), dim=(-2, -1)))


def below_inf(x: torch.Tensor) -> torch.Tensor:
    """Where a norm or a sum of squares (>= 0, or NaN) is finite: one comparison, which NaN
    fails (``isfinite`` is several kernels, each a launch in an eager step)."""
    return x < math.inf


def norm_ok(norm: torch.Tensor) -> torch.Tensor:
    """A step's ``ok`` from its gradients' total norm: 1.0 when the norm is finite, else 0.0."""
    return below_inf(norm).float()


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
        self._flags: torch.Tensor | None = None  # [ok, finite per gradient] or [ok, norm], on the device
        self._names: list[str] = []
        self._norm: torch.Tensor | None = None  # the given gradient norm, a buffer captured steps read
        self._norm_given = False  # the next step takes its flag from ``_norm``
        self._source = "own_pass"  # the flag source of the step built last
        self._sources = dict.fromkeys(SOURCES, 0)
        self._steps = 0  # steps issued since construction (named by "raise")
        self._host: torch.Tensor | None = None  # where the step's flags land (pinned on a GPU)
        self._pending = False
        self._event: torch.cuda.Event | None = None
        self._undo: Callable[[], None] | None = None

    # ----------------------------------------------------------------- the given norm (host side)
    def use_gradient_norm(self, norm: torch.Tensor) -> None:
        """The next step's gradients have total norm ``norm`` (a plain scalar tensor on their
        device, the same on every rank, covering every gradient the step reads): that step
        takes its flag from it instead of its own pass. Call before the step, outside any CUDA
        graph; the value is copied into a buffer, so the tensor may be reused afterwards."""
        if isinstance(norm, DTensor):
            raise TypeError(
                "use_gradient_norm: pass the norm as a plain tensor, reduced over every rank "
                "(DTensor.full_tensor()), not a DTensor"
            )
        if norm.numel() != 1:
            raise ValueError(f"use_gradient_norm: the norm must be one number, got shape {tuple(norm.shape)}")
        if self._norm is None or self._norm.device != norm.device:
            self._norm = torch.zeros((), dtype=torch.float32, device=norm.device)
        # float32: a norm beyond its range becomes inf, and counts as non-finite
        self._norm.copy_(norm.detach().reshape(()), non_blocking=True)
        self._norm_given = True

    @property
    def norm_given(self) -> bool:
        """Whether the next step takes its flag from a given gradient norm."""
        return self._norm_given

    # ----------------------------------------------------------------- device side (capturable)
    def check(self, local_grads: Callable[[], Sequence[tuple[str, torch.Tensor]]], device: torch.device) -> None:
        """Compute this step's ``ok``: from the given gradient norm, or from the local
        gradients (one multi-tensor reduction and, in a distributed run, one all-reduce of the
        flag so every rank decides alike). ``local_grads()`` lists them by name; it is called
        only for the own pass, so a step given a norm has no per-gradient Python either."""
        if self._norm_given:
            self._source = "gradient_norm"
            ok = norm_ok(self._norm).reshape(1)
            self._set_flags(torch.cat([ok, self._norm.reshape(1)]))
            return
        self._source = "own_pass"
        named_grads = local_grads()
        self._names = [name for name, _ in named_grads]
        grads = [g for _, g in named_grads]
        if grads:
            # max |g| per tensor: finite exactly when every entry is (NaN propagates)
            finite = below_inf(torch.stack(torch._foreach_norm(grads, ord=float("inf")))).float()
            ok = finite.min().reshape(1)
        else:
            finite = torch.zeros(0, device=device)
            ok = torch.ones(1, device=device)
        if _distributed():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        self._set_flags(torch.cat([ok, finite]))

    def _set_flags(self, flags: torch.Tensor) -> None:
        self._flags = flags
        self.ok = flags[0]
        self._ok_bool = self.ok > 0

    def publish(self) -> None:
        """The step's last device op: copy its flags to host memory, where ``resolve`` reads
        them once the step is done. The buffer is pinned so the copy is asynchronous and can be
        captured; it is allocated by the first (eager) step, never during a capture."""
        flags = self._flags
        if flags is None:
            return
        if not flags.is_cuda:
            self._host = flags  # a CPU step has already run
            return
        if self._host is None or self._host.shape != flags.shape:
            self._host = torch.empty(flags.shape, dtype=flags.dtype, device="cpu", pin_memory=True)
        self._host.copy_(flags, non_blocking=True)

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
        self,
        result: torch.Tensor,
        void_in_kernel: bool = False,
        row_sq: torch.Tensor | None = None,
        bad: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A Newton-Schulz result (B, n, m) with no non-finite matrix, and which matrices were
        not finite (B,), for ``count_ns``. A non-finite matrix becomes zero, so its update
        subtracts nothing, except with ``void_in_kernel``: the update kernel zeroes it itself
        (the caller passes it the returned flags), so no pass over the batch. Which matrices:
        ``bad`` where NS's last product flagged them (orthogonalize.ResultCheck), else from
        ``row_sq``, the result's rows' sums of squares, if computed, else by a pass of its own."""
        if bad is None:
            bad = nonfinite_matrices(result, row_sq)
        if not void_in_kernel:
            result = torch.where(bad[:, None, None], torch.zeros_like(result), result)
        return result, bad

    def count_ns(self, bad: torch.Tensor) -> None:
        """Add the matrices ``orthogonalized`` found not finite (B,) to the device counter
        (``ns_events``). One stream at a time: the add reads and writes the counter."""
        if bad.numel():
            if self._ns_bad is None:
                self._ns_bad = torch.zeros((), dtype=torch.int64, device=bad.device)
            self._ns_bad += bad.sum()

    # ----------------------------------------------------------------- host side
    def issued(self, undo: Callable[[], None] | None = None) -> None:
        """The step whose flags were published last is queued; ``undo`` rolls back what the host
        advanced for it (selection seeds, step counters) if it turns out skipped. A given
        gradient norm served this step only: the next one needs a norm of its own."""
        if self._norm_given != (self._source == "gradient_norm"):
            raise RuntimeError(  # a replay of a step captured for the other flag source
                "NonfiniteGuard: the step was built for a different flag source than this step's"
            )
        self._norm_given = False
        self._steps += 1
        self._sources[self._source] += 1
        self._pending = self._host is not None
        self._undo = undo
        self._event = None
        if self._pending and self._host.is_pinned():
            self._event = torch.cuda.Event()
            self._event.record()

    def resolve(self) -> None:
        """Act on the flags of the last issued step, if not done yet: wait for that step (not
        for work queued after it), then count a skipped step ("skip") or raise
        FloatingPointError ("raise"), after the step's ``undo``. In a distributed run every
        rank gets here at the same step (the flag is global)."""
        if not self._pending:
            return
        self._pending = False
        if self._event is not None:
            self._event.synchronize()
        host = self._host.tolist()
        undo, self._undo, self._event = self._undo, None, None
        if host[0] == 1.0:
            return
        if undo is not None:
            undo()
        if self.policy == "skip":
            self._skipped += 1
            return
        if self._source == "gradient_norm":
            raise FloatingPointError(
                f"Dion3: the gradient norm of step {self._steps} (counted since the optimizer was built) is "
                f"{host[1]}: some gradient is not finite; nothing of that step was applied "
                "(set [optimizer] nonfinite = 'skip' to skip such steps)"
            )
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
    def flag_sources(self) -> dict[str, int]:
        """Steps issued so far by where their flag came from: "gradient_norm" (given, no pass
        over the gradients) or "own_pass"."""
        return dict(self._sources)

    @property
    def ns_events(self) -> int:
        """Matrices whose Newton-Schulz result was not finite so far. Synchronizes."""
        return 0 if self._ns_bad is None else int(self._ns_bad)
