"""Flavors of the matrix update (Muon, NorMuon): everything a flavor adds to the Dion3
pipeline, in one place.

A flavor owns its state keys, the per-row data that travels with the selected rows (gathered
to the owner with them and scattered back), and its normalization of the orthogonalized rows
as factors that the update applies (row denominators, matrix scales: they travel back beside
the NS result, which stays in its dtype), computed by torch ops on the reference path and by
the row engine's kernel on its own. The pipeline in
dion3.py asks the flavor and never tests its name; a new flavor is one class here and its name
in ``FLAVORS`` (and in the config's allowed values).
"""

from __future__ import annotations

import torch

from dion3_titan.dist.layout import describe, row_state, to_local
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.update import normuon_factors


class Flavor:
    """Muon: the orthogonalized rows are the update; no state and no per-row data."""

    name = "muon"
    row_data = False  # per-row data travels with the rows (one extra column in the exchange)
    reads_row_sums = False  # the row engine's epilogue reads the NS result's rows' sums of squares

    def create_state(self, state: dict, member) -> None:
        """Add this flavor's state tensors for ``member`` to the parameter's ``state``."""

    def rows_state(self, state: dict, member) -> torch.Tensor | None:
        """(B, R) local view of the member's per-row state (None: the flavor has none)."""
        return None

    def factors(
        self, ortho: torch.Tensor, data: torch.Tensor | None, cfg: Dion3Config, cols: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Reference path, on the owner: (row denominators (N, K), matrix scales (N,), new
        per-row data) of the NS result ``ortho`` (update.apply_row_factors); (None, None, data)
        when the result is the update as it is."""
        return None, None, data

    def epilogue(
        self,
        row_sq: torch.Tensor | None,
        data: torch.Tensor | None,
        cfg: Dion3Config,
        cols: int,
        void: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Row engine: (row denominators, matrix scales, new per-row data) that the update
        kernel applies to the NS result itself, from its rows' sums of squares ``row_sq`` (N, K)
        (computed for a flavor that ``reads_row_sums``, else None); (None, None, data) when
        there is nothing to apply."""
        return None, None, data


class NorMuon(Flavor):
    """NorMuon: each selected row is divided by the root of its second moment (an EMA of the
    row's mean square), the matrix rescaled to the NS result's Frobenius norm (paper Sec. 6)."""

    name = "normuon"
    row_data = True
    reads_row_sums = True

    def create_state(self, state: dict, member) -> None:
        if member.variance_key in state:
            return  # pieces that select rows share one state over the parameter's rows
        # (laid out like the parameter's rows, so DCP reshards it however shards cut the pieces)
        shares = member.piece is not None and member.layout.row_dim == -2
        state[member.variance_key] = row_state(
            member.param, describe(member.param, "rows") if shares else member.layout
        )

    def rows_state(self, state: dict, member) -> torch.Tensor:
        return member.variance_view(to_local(state[member.variance_key]))

    def factors(self, ortho, data, cfg, cols):
        return normuon_factors(ortho, data, cfg.normuon_beta2, cfg.normuon_eps, cols)

    def epilogue(self, row_sq, data, cfg, cols, void):
        from dion3_titan.optim import engine

        return engine.normuon_factors(row_sq, data, cfg.normuon_beta2, cfg.normuon_eps, cols, void)


FLAVORS: dict[str, Flavor] = {f.name: f for f in (Flavor(), NorMuon())}
