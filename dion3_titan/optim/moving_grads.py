"""Gradients that move between the replays of a captured step, read where they are.

A captured step's kernels read each gradient at the address it had at capture. Trainers hand
out new gradient tensors every step (``zero_grad(set_to_none=True)``, FSDP2's reduce-scatter
output), so before a replay each gradient would be copied into its captured tensor: 8 bytes
per float32 parameter (8 GB a step for a 1B model), inside the optimizer's time. Keeping
gradients in place instead costs more, outside it: a memset and a read-modify-write by
autograd's accumulation, 16 bytes per parameter.

The row engine's accumulate pass, the one reader of a matrix's gradient, reads it through a
table of offsets. Built with a ``MovingGradients``, those tables are movable
(``row_engine.MovableOperand``), and ``move`` points them at a parameter's new gradient:
a small host-to-device copy instead of a pass over the gradient. The caller copies what this
does not cover: gradients other kernels read too (AdamW's, those added by torch ops, all of
them when the step makes its own finiteness pass over the gradients, whose tables then stay
where they were captured), and a gradient whose new place breaks its table's alignment or has
other strides. A capture makes these tables in any case: the row engine's cached tables are
keyed by the gradients' addresses and cannot be built during a capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dion3_titan.dist.plan import Member
from dion3_titan.kernels.row_engine import MovableOperand


class MovingGradients:
    """The movable gradient operands of one captured step, by parameter. Their tables are rows
    of one block allocated here, before the capture (``row_engine.MovableOperand`` says why):
    ``matrices`` rows, one per matrix the step accumulates (its shape groups' batches)."""

    def __init__(self, matrices: int, device: torch.device) -> None:
        self._tables = torch.empty((matrices, 4), dtype=torch.int64, device=device)
        self._used = 0
        self._operands: list[MovableOperand] = []
        self._uses: dict[int, list[tuple[MovableOperand, int]]] = {}  # id(param) -> (operand, view)

    def operand(
        self, members: Sequence[Member], views: Sequence[torch.Tensor], present: Sequence[bool]
    ) -> MovableOperand:
        """The gradient operand of one accumulate launch: ``views`` of the members' gradients
        (``present`` False: stand-ins, never read). Its table is written by ``flush``."""
        rows = sum(v.shape[0] for v in views)
        if self._used + rows > self._tables.shape[0]:
            raise RuntimeError(
                f"MovingGradients: the step accumulates more than the {self._tables.shape[0]} matrices counted"
            )
        op = MovableOperand(views, present, self._tables[self._used : self._used + rows])
        self._used += rows
        self._operands.append(op)
        for i, (m, here) in enumerate(zip(members, present)):
            if here:
                self._uses.setdefault(id(m.param), []).append((op, i))
        return op

    @property
    def operands(self) -> tuple[MovableOperand, ...]:
        """The operands made so far, in the order the step's accumulate launches made them."""
        return tuple(self._operands)

    def covers(self, param: torch.Tensor) -> bool:
        """Whether the captured step reads ``param``'s gradient through movable tables."""
        return id(param) in self._uses

    def move(self, param: torch.Tensor, delta_bytes: int) -> bool:
        """``param``'s gradient (local tensor, same shape and strides) now lies ``delta_bytes``
        from where it was captured: point every launch that reads it there. False, and nothing
        changed, when a table's alignment does not allow it (then the caller copies)."""
        uses = self._uses[id(param)]
        if not all(op.can_move(i, delta_bytes) for op, i in uses):
            return False
        for op, i in uses:
            op.move(i, delta_bytes)
        return True

    def flush(self) -> None:
        """Write the tables that changed (before the replay, on its stream)."""
        for op in self._operands:
            op.flush()
