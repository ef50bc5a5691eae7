"""The row engine's implementation of a step's stages (optim/stages.py): the fused Triton
kernels of optim/engine.py, one launch per shape group, each byte of momentum and weights
touched once per stage. Where nothing moves, the selected rows go straight into the
Newton-Schulz batch (normalized and cast in the same pass) and the update kernel applies the
flavor's epilogue and voids non-finite results itself."""

from collections.abc import Callable, Mapping, Sequence

import torch

from dion3_titan.dist.layout import to_local
from dion3_titan.kernels import Backend, select_backend
from dion3_titan.optim import engine
from dion3_titan.optim.moving_grads import MovingGradients
from dion3_titan.optim.orthogonalize import is_transposed_batch
from dion3_titan.optim.selection import Selection
from dion3_titan.optim.stages import Factors, GroupStep, Normalized, Packed, RowStats, Stages


class RowEngineStages(Stages):
    name = "row_engine"

    def __init__(self) -> None:
        self._untiled: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}  # by the groups' ids

    def accumulate(
        self,
        steps: Sequence[GroupStep],
        momentum: Callable[[torch.Tensor], torch.Tensor],
        moving: MovingGradients | None = None,
        feedback: Mapping[int, float] | None = None,
    ) -> dict[int, RowStats]:
        """M += G and each row's l1 norm and sum of squares, one launch per shape group; the
        gradients read through ``moving``'s tables when given. A group in ``feedback`` gets
        its error feedback in the same launch: the pack then writes no momentum back (4 bytes
        per element less at f = 1)."""
        if not steps:
            return {}
        feedback = feedback or {}
        sums = {}
        for g in steps:
            l1 = torch.empty(g.sg.batch, g.sg.local_rows, dtype=torch.float32, device=g.momenta[0].device)
            sums[id(g.sg)] = (l1, torch.empty_like(l1))
        key = tuple(id(g.sg) for g in steps)  # the plan's groups live as long as the optimizer
        if key not in self._untiled:
            self._untiled[key] = engine.untiled_params([(g.members, g.momenta) for g in steps], momentum)
        decayed = engine.accumulate(
            [(g.members, g.momenta, *sums[id(g.sg)], feedback.get(id(g.sg))) for g in steps],
            lambda p: None if p.grad is None else to_local(p.grad),
            steps[0].guard,
            self._untiled[key],
            momentum,
            steps[0].tables,
            moving,
        )
        return {id(g.sg): RowStats(*sums[id(g.sg)], done) for g, done in zip(steps, decayed)}

    def selected_sumsq(self, g: GroupStep, sel: Selection, stats: RowStats | None) -> torch.Tensor:
        return engine.selected_sumsq(stats.sq, None if sel.every_row else sel.rows, sel.valid)

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
        """Selected rows, normalized and cast, straight into the NS batch at the backend's Gram
        side when nothing moves, else into the send buffer (as the momentum is without
        ``norm_sq``). The same launch applies the error feedback to the rows it reads (not the
        update), unless the accumulate did (``stats.decayed``): the rows read are then mu times
        the momentum, and so is their norm."""
        mu, scale = factors.momentum, None
        if stats is not None and stats.decayed:
            mu, scale = None, factors.mu  # exactly 1 on a step the accumulate left alone
        sg, views = g.sg, g.momenta
        # the flavor's per-row state travels with the rows
        row_data = None if g.row_states is None else engine.gather_row_state(g.row_states, sel.rows, sg.k, g.tables)
        whole, shape, dtype = self._batch(g, moves, tall, norm_sq)
        x = engine.pack(
            views,
            None if sel.every_row else sel.rows,
            sel.valid,
            g.active,
            shape,
            dtype,
            sq=stats.sq if whole else None,
            eps=g.ns.eps,
            transposed=whole and sel.every_row and is_transposed_batch(views),
            tables=g.tables,
            mu=mu,
            ok=g.guard.ok,
            norm_scale=scale,
            sumsq=norm_sq,
        )
        at_side = whole and not tall and shape[1] > sg.k
        return Packed(x, row_data, whole or norm_sq is not None, sg.k if at_side else None)

    def _batch(
        self, g: GroupStep, moves: bool, tall: bool, norm_sq: torch.Tensor | None
    ) -> tuple[bool, tuple[int, int, int], torch.dtype]:
        """What ``pack`` writes: (whether it is the whole of this rank's NS batch, the buffer's
        shape, its dtype)."""
        sg = g.sg
        if not moves and sg.cols == sg.local_cols and sg.k == sg.selected:
            return True, (sg.batch, sg.k if tall else self._gram_side(g), sg.cols), g.ns.dtype
        return False, (sg.batch, sg.k, sg.cols), g.momenta[0].dtype if norm_sq is None else g.ns.dtype

    @staticmethod
    def _gram_side(g: GroupStep) -> int:
        """The rows of a wide NS batch: the side its backend's kernels prefer for k rows."""
        sg, cfg = g.sg, g.cfg
        backend = select_backend(cfg.backend, (sg.batch, sg.k, sg.cols), cfg.compute_dtype, g.momenta[0].device)
        return backend.gram_side(sg.k)

    def voids_in_kernel(self, moves: bool) -> bool:
        return not moves

    def result_row_sums(self, g: GroupStep, ortho: torch.Tensor) -> torch.Tensor | None:
        # for the finiteness check too where NS's last product did not flag its result: this one
        # Triton pass runs near the memory rate where torch's per-matrix max reduction did not
        # (docs/benchmarks.md)
        return engine.row_sumsq(ortho)

    def normalize(
        self,
        g: GroupStep,
        ortho: torch.Tensor,
        row_data: torch.Tensor | None,
        void: torch.Tensor,
        row_sq: torch.Tensor | None,
    ) -> Normalized:
        # the update kernel applies it (epilogue), from result_row_sums' row sums; where the
        # rows move, its factors travel beside them
        cols = g.members[0].layout.global_cols
        den, scale, data = g.flavor.epilogue(row_sq, row_data, g.cfg, cols, void)
        return Normalized(ortho, data, den, scale)

    def splits_decay(self, sel: Selection, factors: Factors) -> bool:
        return factors.decays and not sel.every_row

    def decay_unselected(self, g: GroupStep, sel: Selection, factors: Factors) -> None:
        slot = engine.slots(sel.rows, sel.valid, g.sg.local_rows)
        engine.decay_unselected(g.weights, slot, factors.decay, g.guard.ok, g.active, g.tables)

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
        """The whole group's update, epilogue and new per-row state in one launch (a step with a
        non-finite gradient leaves weights, momentum and state as they are)."""
        sg = g.sg
        slot = rows = None
        if not sel.every_row and factors.decays and not rest_decayed:  # every row decays: visit all
            slot = engine.slots(sel.rows, sel.valid, sg.local_rows)
        elif not sel.every_row:
            rows = engine.applied_rows(sel.rows, sel.valid)
        row_state = (
            None if g.row_states is None else engine.RowState(g.row_states, norm.row_data[:, : sg.selected].float())
        )
        engine.update(
            g.weights,
            None,  # the error feedback was applied by pack
            norm.rows,
            slot,
            factors.lr,
            factors.decay if factors.decays else None,
            factors.momentum,
            [m.lr_scale for m in g.members],
            None if norm.den is None else norm.den[:, : sg.selected],
            norm.scale,
            ok=g.guard.ok,
            void=void,
            row_state=row_state,
            active=g.active,
            tables=g.tables,
            rows=rows,
        )
