"""The stages of a Dion3 step that have two implementations, and what passes between them.

A step (optim/dion3.py) runs, per shape group: accumulate, select, pack, exchange,
orthogonalize, normalize, exchange back, update. Selection (optim/selection.py), the exchanges
(dist/comm.py) and Newton-Schulz (optim/orthogonalize.py) are the same everywhere. Four stages
differ by where they run, and ``Stages`` is their interface:

- ``ReferenceStages`` (stages_reference.py): torch ops, one tensor at a time. Any device; the
  reference the other is tested against.
- ``RowEngineStages`` (stages_engine.py): the row engine's fused Triton kernels (GPU, or any
  device under TRITON_INTERPRET=1), one launch per shape group, each byte of momentum and
  weights touched once per stage.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dion3_titan.dist.layout import to_local
from dion3_titan.dist.plan import Member, ShapeGroup
from dion3_titan.kernels import Backend
from dion3_titan.kernels.row_engine import TableCache
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.flavors import Flavor
from dion3_titan.optim.moving_grads import MovingGradients
from dion3_titan.optim.nonfinite import NonfiniteGuard
from dion3_titan.optim.orthogonalize import NSSettings
from dion3_titan.optim.selection import Selection


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of a shape group's momentum (N, R) float32, from the accumulate pass."""

    l1: torch.Tensor  # l1 norms: the selection scores
    sq: torch.Tensor  # sums of squares: the Frobenius norm of the selected rows without a second read
    # the pass stored M times mu (a selection of every row: their error feedback), its
    # statistics still those of M: the pack reads mu * M and applies no feedback of its own
    decayed: bool = False


@dataclass(frozen=True)
class GroupStep:
    """One shape group in this step: its settings and the local (B, R, C) views of its members."""

    sg: ShapeGroup
    cfg: Dion3Config
    ns: NSSettings
    flavor: Flavor
    momenta: Sequence[torch.Tensor]  # kept from step to step (kernels/row_engine/operands.py KeptViews)
    weights: Sequence[torch.Tensor]
    row_states: Sequence[torch.Tensor] | None  # the flavor's per-row state (B, R) per member, or None
    active: list[bool]  # a member without a gradient contributes nothing and receives no update
    guard: NonfiniteGuard
    tables: TableCache

    @property
    def members(self) -> list[Member]:
        return self.sg.members


@dataclass(frozen=True)
class Packed:
    """The group's selected rows, ready for the exchange (or, when nothing moves, for NS)."""

    x: torch.Tensor  # (N, K, C), zero-padded
    row_data: torch.Tensor | None  # (N, K) per-row data that travels with the rows
    normalized: bool  # x is already Newton-Schulz's input (scaled, in its dtype)
    # x's real rows where it is packed at the backend's Gram side (the rows past them are zero)
    rows: int | None = None


@dataclass(frozen=True)
class Normalized:
    """The flavor's normalization of the orthogonalized rows: the NS result (in its dtype), the
    rows' new per-row data, and the factors the update applies, each row divided by its
    ``den`` and each matrix times its ``scale`` (None: the result is the update as it is). On
    the owner, or (``Dion3._exchange_back``) a shard's rows of it."""

    rows: torch.Tensor
    row_data: torch.Tensor | None
    den: torch.Tensor | None = None  # (N, K) row denominators
    scale: torch.Tensor | None = None  # (N,) matrix scales


@dataclass(frozen=True)
class Factors:
    """This step's factors of a matrix group, live device scalars (a captured step reads them)."""

    lr: torch.Tensor  # 0 on a step with a non-finite gradient
    decay: torch.Tensor  # 1 - lr' * weight_decay (exactly 1 on such a step)
    mu: torch.Tensor  # the momentum decay of the selected rows (exactly 1 on such a step)
    momentum: float  # mu as configured (kernels gate it themselves)
    # weight_decay != 0: the rows that are not selected change too. Without it a stage may
    # leave them unread (decay is then exactly 1); a captured step bakes this in (its signature)
    decays: bool = True


# Takes work of a shape group that may run beside the rest of its pipeline (on another stream:
# optim/overlap.py) once everything queued before the hand-over is done.
Aside = Callable[[Callable[[], None]], None]


@dataclass(frozen=True)
class Outcome:
    """What a shape group's step leaves for the step's counters (non-finite NS results, the
    metrics): taken on the step's stream, group by group."""

    g: GroupStep
    sel: Selection
    result: torch.Tensor  # (N, selected, C_local): this rank's rows of the NS results
    norm: Normalized
    lr: torch.Tensor
    void: torch.Tensor | None  # matrices the update took as zero (in the kernel)
    bad: torch.Tensor  # (N_owned,) NS results found not finite


class Stages:
    """The stages whose implementation differs between the torch reference and the row engine."""

    name = "abstract"

    def accumulate(
        self,
        steps: Sequence[GroupStep],
        momentum: Callable[[torch.Tensor], torch.Tensor],
        moving: MovingGradients | None = None,
        feedback: Mapping[int, float] | None = None,
    ) -> dict[int, RowStats]:
        """1. M <- M + G (gated by the groups' guard), once per parameter of the groups
        ``steps``; ``momentum(param)``: its whole local momentum. Returns the row statistics by
        id(shape group) where this implementation computes them in the same pass.
        ``moving`` (a captured step): gradients this implementation reads through movable
        tables are registered there (optim/moving_grads.py); the rest stay where they are.
        ``feedback``: mu by id(group) of the groups that select every row this step; an
        implementation may apply their error feedback here (``RowStats.decayed``)."""
        raise NotImplementedError

    def selected_sumsq(self, g: GroupStep, sel: Selection, stats: RowStats | None) -> torch.Tensor:
        """(N,) float32, per matrix: the sum of squares of the rows ``pack`` takes, of the
        momentum as ``stats`` describes it (this rank's part of a matrix that other ranks hold
        parts of: summed over them it is ``pack``'s ``norm_sq``)."""
        raise NotImplementedError

    def pack(
        self,
        g: GroupStep,
        sel: Selection,
        stats: RowStats | None,
        moves: bool,
        tall: bool,
        factors: Factors,
        norm_sq: torch.Tensor | None = None,
    ) -> Packed:
        """3. The selected rows of the group's momentum (and per-row data), zero-padded to the
        group's fixed block. ``moves``: the batch goes to other ranks (else it is this rank's
        own NS batch); ``tall``: NS works on its transpose. ``norm_sq`` (N,): the rows that
        move go as Newton-Schulz's input, each matrix divided by the root of its entry + eps
        and cast to the NS dtype (half the bytes of the momentum's float32). An
        implementation may apply the error feedback (the selected momentum rows times
        ``factors.mu``) here, where it reads those rows anyway; its ``update`` then leaves the
        momentum alone."""
        raise NotImplementedError

    def voids_in_kernel(self, moves: bool) -> bool:
        """Whether the update zeroes a non-finite NS result itself (no pass over the batch)."""
        return False

    def result_row_sums(self, g: GroupStep, ortho: torch.Tensor) -> torch.Tensor | None:
        """The NS result's rows' sums of squares (N, K) float32 where an implementation computes
        them in one pass, else None. Asked for where the flavor ``reads_row_sums`` (``normalize``
        gets them) or NS's last product did not flag its non-finite matrices (the result's
        finiteness check reads them then)."""
        return None

    def normalize(
        self,
        g: GroupStep,
        ortho: torch.Tensor,
        row_data: torch.Tensor | None,
        void: torch.Tensor,
        row_sq: torch.Tensor | None,
    ) -> Normalized:
        """6. The flavor's normalization of the owner's NS results (``void``: matrices taken as
        zero; ``row_sq``: ``result_row_sums``), as the factors the update applies: the rows
        stay the NS result, in its dtype (half the bytes of float32 on the way back to the
        shards)."""
        raise NotImplementedError

    def splits_decay(self, sel: Selection, factors: Factors) -> bool:
        """Whether the weight decay of the rows ``sel`` leaves out can run apart from the
        update (``decay_unselected``, e.g. on another stream while the group's NS runs)."""
        return False

    def decay_unselected(self, g: GroupStep, sel: Selection, factors: Factors) -> None:
        """The weight decay of the rows ``sel`` leaves out (where ``splits_decay``)."""
        raise NotImplementedError

    def update(
        self,
        g: GroupStep,
        sel: Selection,
        norm: Normalized,
        factors: Factors,
        backend: Backend,
        void: torch.Tensor | None,
        rest_decayed: bool = False,
    ) -> None:
        """8. Weight decay on every row (on the selected ones only when ``rest_decayed``:
        ``decay_unselected`` takes the others), the update of the selected rows (one
        rounding), the error-feedback decay of their momentum (unless ``pack`` applied it) and
        the flavor's new per-row state. ``norm``: this rank's rows of the normalized results
        (N, selected, C_local), their per-row data and factors."""
        raise NotImplementedError


def gradients_once(groups: Sequence[ShapeGroup]) -> list[tuple[Member, torch.Tensor]]:
    """(member, local gradient) of each parameter of ``groups`` that has a gradient, once per
    parameter (a split parameter has several members)."""
    seen: set[int] = set()
    out = []
    for sg in groups:
        for m in sg.members:
            if m.param.grad is not None and id(m.param) not in seen:
                seen.add(id(m.param))
                out.append((m, to_local(m.param.grad)))
    return out
