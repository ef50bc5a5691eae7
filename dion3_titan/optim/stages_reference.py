"""The reference implementation of a step's stages (optim/stages.py): torch ops on each member's
views. It runs on any device and is what the row engine is tested against."""

from collections.abc import Callable, Mapping, Sequence

import torch

from dion3_titan.kernels import Backend
from dion3_titan.optim.moving_grads import MovingGradients
from dion3_titan.optim.orthogonalize import is_transposed_batch, normalize_batch
from dion3_titan.optim.selection import Selection
from dion3_titan.optim.stages import Factors, GroupStep, Normalized, Packed, RowStats, Stages, gradients_once
from dion3_titan.optim.update import apply_row_factors, apply_update, take_rows


def _join(views: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate (B, R, C) views along the batch. Views that select W's columns are
    transposed views of contiguous tensors: join those in their own memory order (a coalesced
    copy, not a strided one) and hand back the same transposed view."""
    if is_transposed_batch(views):
        return torch.cat([v.mT for v in views]).mT
    return torch.cat(views)


class ReferenceStages(Stages):
    name = "reference"

    def accumulate(
        self,
        steps: Sequence[GroupStep],
        momentum: Callable[[torch.Tensor], torch.Tensor],
        moving: MovingGradients | None = None,
        feedback: Mapping[int, float] | None = None,
    ) -> dict[int, RowStats]:
        # torch ops read the gradients where they are: nothing registered in ``moving``; the
        # error feedback stays with pack and update
        if steps:
            pairs = gradients_once([g.sg for g in steps])
            steps[0].guard.accumulate([momentum(m.param) for m, _ in pairs], [grad for _, grad in pairs])
        return {}

    def selected_sumsq(self, g: GroupStep, sel: Selection, stats: RowStats | None) -> torch.Tensor:
        # the squared norm: its root gives back the norm's bits, so a matrix whole on this rank
        # is divided exactly as normalize_batch divides it
        x = self._selected(g, sel)
        return torch.linalg.vector_norm(x, dim=(1, 2), dtype=torch.promote_types(x.dtype, torch.float32)).square()

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
        sg, views = g.sg, g.momenta
        row_data = None
        if g.row_states is not None:  # the flavor's per-row state travels with the rows
            row_data = torch.nn.functional.pad(torch.cat(g.row_states).gather(1, sel.rows), (0, sg.k - sg.selected))
        whole = sel.every_row and not moves and sg.cols == sg.local_cols and sg.k == sg.selected
        if whole and all(g.active):
            # The whole momentum stays here: normalize it straight into the NS batch (one
            # pass over each matrix instead of a float32 copy, its norm, a division and a cast).
            return Packed(normalize_batch(views, g.ns.eps, g.ns.dtype), row_data, True)
        send = self._selected(g, sel)
        if norm_sq is not None:  # as orthogonalize normalizes: divided in float32, rounded once
            den = norm_sq.sqrt() + g.ns.eps
            send = torch.div(send, den.view(-1, 1, 1), out=torch.empty_like(send, dtype=g.ns.dtype))
        if sg.cols > sg.local_cols or sg.k > sg.selected:  # (pad copies even when it adds nothing)
            send = torch.nn.functional.pad(send, (0, sg.cols - sg.local_cols, 0, sg.k - sg.selected))
        return Packed(send, row_data, norm_sq is not None)

    @staticmethod
    def _selected(g: GroupStep, sel: Selection) -> torch.Tensor:
        """(N, selected, local_cols): the selected rows of the group's momentum, zero for an
        inactive member and where not ``valid``."""
        views = g.momenta
        if sel.every_row:
            send = _join(views)
        else:
            send = torch.cat([take_rows(v, r) for v, r in zip(views, sel.rows_of(g.members))])
        for m, active in zip(g.members, g.active):
            if not active:  # no gradient: contributes nothing, receives no update
                send[m.offset : m.offset + m.layout.batch] = 0
        if sel.valid is not None:
            send = send * sel.valid.unsqueeze(-1).to(send.dtype)
        return send

    def normalize(
        self,
        g: GroupStep,
        ortho: torch.Tensor,
        row_data: torch.Tensor | None,
        void: torch.Tensor,
        row_sq: torch.Tensor | None,
    ) -> Normalized:
        den, scale, data = g.flavor.factors(ortho, row_data, g.cfg, g.members[0].layout.global_cols)
        return Normalized(ortho, data, den, scale)

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
        """Each member's update (with the flavor's factors) and error feedback, then its state."""
        if rest_decayed:
            raise ValueError("ReferenceStages.update: it decays every row itself (splits_decay is False)")
        rows_of, valid_of = sel.rows_of(g.members), sel.valid_of(g.members)
        updates = norm.rows
        if norm.den is not None:
            updates = apply_row_factors(updates, norm.den[:, : g.sg.selected], norm.scale)
        for i, m in enumerate(g.members):
            if not g.active[i]:
                continue
            sl = slice(m.offset, m.offset + m.layout.batch)
            rows, valid = rows_of[i], valid_of[i]
            apply_update(
                g.weights[i],
                g.momenta[i],
                updates[sl],
                rows,
                valid,
                factors.lr * m.lr_scale,
                factors.decay,
                factors.mu,
                backend,
                sel.every_row,
            )
            if g.row_states is not None:
                state = g.row_states[i]
                new, old = norm.row_data[sl, : g.sg.selected].float(), state.gather(1, rows)
                if valid is not None:
                    new = torch.where(valid, new, old)
                state.scatter_(1, rows, g.guard.keep(new, old))
