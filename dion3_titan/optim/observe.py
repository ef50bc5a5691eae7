"""What the optimizer metrics (dion3_titan/optimizer_metrics.py) read of the matrix steps: per
row, the step it was last selected at, and on measured steps the sums of squares of the updates
by parameter class. Off unless asked for, and never a host synchronization in a step."""

import torch

from dion3_titan.dist.layout import MatrixLayout, to_local
from dion3_titan.dist.plan import ShapeGroup
from dion3_titan.optim.routing import param_class
from dion3_titan.optim.selection import Selection
from dion3_titan.optim.stages import GroupStep, Normalized


class Observer:
    def __init__(self) -> None:
        self.last_selected: dict[int, torch.Tensor] | None = None  # member id -> (B, R) step stamps
        self.step_t: torch.Tensor | None = None  # steps taken since tracking began (device)
        self.measure_updates = False  # set on logging steps: accumulate update sums of squares
        self.update_sumsq: dict[str, torch.Tensor] = {}
        self.update_numel: dict[str, int] = {}

    def track_selection(self, groups: list[ShapeGroup]) -> None:
        """Keep, per matrix row, the step it was last selected at (for selection metrics)."""
        if self.last_selected is not None:
            return
        device = next((to_local(m.param).device for sg in groups for m in sg.members), torch.device("cpu"))
        self.step_t = torch.zeros((), dtype=torch.int64, device=device)
        self.last_selected = {
            id(m): torch.zeros(m.layout.batch, m.layout.local_rows, dtype=torch.int64, device=to_local(m.param).device)
            for sg in groups
            for m in sg.members
        }

    def count_step(self, ok: torch.Tensor) -> None:
        """A step begins (``ok``: its gradients were finite, so it counts)."""
        if self.step_t is not None:
            self.step_t += ok.to(torch.int64)

    def selection_stats(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(share of this rank's rows selected within the last ``window`` steps, age in steps
        of the longest-unselected row), as device scalars."""
        if not self.last_selected:
            zero = torch.zeros(())
            return zero, zero
        last = torch.cat([t.flatten() for t in self.last_selected.values()])
        ages = self.step_t - last  # a never-selected row (stamp 0) is as old as the tracking
        return ((ages < window) & (last > 0)).float().mean(), ages.max()

    def record(
        self,
        g: GroupStep,
        sel: Selection,
        result: torch.Tensor,
        norm: Normalized,
        lr: torch.Tensor,
        void: torch.Tensor | None,
    ) -> None:
        """Selection stamps and update sums of squares of each member that got an update."""
        if self.last_selected is None and not self.measure_updates:
            return
        rows_of, valid_of = sel.rows_of(g.members), sel.valid_of(g.members)
        selected = g.sg.selected
        for i, m in enumerate(g.members):
            if not g.active[i]:
                continue
            sl = slice(m.offset, m.offset + m.layout.batch)
            rows, ok = rows_of[i], valid_of[i]
            if self.last_selected is not None:
                stamps = self.last_selected[id(m)]
                stamp, old = self.step_t.expand_as(rows), stamps.gather(1, rows)
                if ok is not None:
                    stamp = torch.where(ok, stamp, old)
                stamps.scatter_(1, rows, g.guard.keep(stamp, old))
            if self.measure_updates:
                applied = result[sl].float()
                if norm.den is not None:
                    applied = applied / norm.den[sl, :selected, None] * norm.scale[sl, None, None]
                if void is not None:
                    applied = torch.where(void[sl, None, None], 0.0, applied)
                self._add_sumsq(m.name, (lr * m.lr_scale) * applied, m.layout)

    def _add_sumsq(self, name: str, update: torch.Tensor, layout: MatrixLayout) -> None:
        cls = param_class(name)
        value = update.square().sum()
        self.update_sumsq[cls] = self.update_sumsq.get(cls, 0) + value
        # every row decays, only the selected ones move: RMS over the whole matrix
        self.update_numel[cls] = self.update_numel.get(cls, 0) + layout.batch * layout.local_rows * layout.local_cols
