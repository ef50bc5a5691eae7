"""Periodic Row-wise Muon (Li et al., "Scaling Muon for Diffusion Transformers", Sec. 3.2-3.3,
App. C Alg. 1-2): a full Newton-Schulz refresh every K steps, gamma * RowNorm in between.

Step t of a matrix group (t counts from 0, so the first step refreshes; Alg. 1 line 3):

    M_t = mu * M_{t-1} + G_t                      heavy-ball momentum, mu = 0.95 in the paper
    D_t = NS(O(M_t))                   if t % K == 0   (refresh)
        = gamma * R_eps(O(M_t))        otherwise       (R_eps: row / max(||row||_2, eps))
    W_{t+1} = (1 - lr * wd) * W_t - lr * s(W) * O^-1(D_t)

Both branches act on the current momentum M_t itself (Sec. 2, 3.2: "we use the current
momentum M_t"); the paper never uses a Nesterov look-ahead, so neither do we.
O orients the matrix so its rows are the smaller dimension; s(W) is our ``lr_scale`` (the paper
leaves s unspecified; "spectral" gives Muon's sqrt(d_out / d_in)). Our engine keeps the stored
momentum as A = mu * M_{t-1}: a step adds G (A + G = M_t), computes D from it, then decays the
whole momentum by mu. That is the same sequence as M_t = mu * M_{t-1} + G_t. Both maps are
scale-free, so the paper's choice between this sum and an EMA (1 - mu) * G only matters
through eps.

Refresh steps run the Dion3 pipeline unchanged with fraction 1 and the Muon flavor (our
megabatch plan: one batch per shape group, owners by load balance), so any of our NS choices
apply. The defaults reproduce the paper's NS5: Muon's quintic (3.4445, -4.7750, 2.0315), five
steps, no safety rescaling, standard NS. RowNorm steps work on local shards (rownorm.py).
AdamW groups are untouched.
"""

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

import torch

from dion3_titan.dist.layout import to_local
from dion3_titan.dist.plan import Member, ShapeGroup
from dion3_titan.kernels import select_backend
from dion3_titan.optim.config import Dion3Config
from dion3_titan.optim.dion3 import ADAMW_DEFAULTS, Dion3
from dion3_titan.optim.moving_grads import MovingGradients
from dion3_titan.optim.rownorm import (
    SplitGroups,
    orient,
    reduce_row_stats,
    row_sq_sums,
    rownorm_direction,
    rownorm_row_dim,
    split_groups,
)

# Param-group key of the step counter t (per matrix group, so it is saved and restored with the
# group by state_dict / DCP like any hyperparameter).
STEP_KEY = "prmuon_step"

# Defaults of shared keys that differ from Dion3's: the paper's NS5 (App. D.3).
NS_DEFAULTS = {"ns_coefficients": "muon", "ns_steps": 5, "ns_safety_factor": 1.0, "ns_algorithm": "standard"}

# Shared keys PRMuon pins: a refresh orthogonalizes every row, with no NorMuon normalization,
# and RowNorm steps read every row of the momentum, which compressed sync leaves unsynced.
FIXED = {"fraction": 1.0, "flavor": "muon", "replicate_sync": "gradients"}
_WHY_FIXED = {
    "fraction": "refreshes orthogonalize every row",
    "flavor": "refreshes are Muon's",
    "replicate_sync": "RowNorm steps need every replica's whole momentum",
}


@dataclass
class PRMuonConfig:
    """The keys Periodic Row-wise Muon adds to ``Dion3Config`` (TOML ``[optimizer]`` keys too)."""

    refresh_period: int = 3  # K >= 1: full NS at steps t % K == 0; K = 1 is Muon
    rownorm_gamma: float = 0.15  # gamma > 0: RowNorm steps' lr multiplier (paper Sec. 3.2)
    rownorm_eps: float = 1e-8  # eps > 0: row norms are clamped to >= eps (paper leaves it open)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        k = self.refresh_period
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"refresh_period={k!r}: must be an integer >= 1 (1 refreshes every step)")
        for key in ("rownorm_gamma", "rownorm_eps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 < v < math.inf):
                raise ValueError(f"{key}={v!r}: must be a finite number > 0")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class PeriodicRowwiseMuon(Dion3):
    """Periodic Row-wise Muon for matrix groups, AdamW for ``algorithm="adamw"`` groups.

    Takes Dion3's keyword names plus ``refresh_period``, ``rownorm_gamma`` and ``rownorm_eps``
    (any of them may also be set per param group). ``fraction`` must be 1 and ``flavor``
    "muon". The step counter lives in each matrix group under ``"prmuon_step"``, so
    ``state_dict`` / ``load_state_dict`` (and DCP) resume mid-period exactly.
    """

    HOST_COUNTERS = (*Dion3.HOST_COUNTERS, STEP_KEY)

    def __init__(self, params: Iterable, lr: float = 0.02, **options) -> None:
        allowed = set(Dion3Config.keys()) | set(PRMuonConfig.keys()) | set(ADAMW_DEFAULTS)
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"PeriodicRowwiseMuon: unknown option(s) {sorted(unknown)}; allowed are {sorted(allowed)}")
        own = PRMuonConfig(**{k: options.pop(k) for k in PRMuonConfig.keys() if k in options})
        if options.get("split_specs") or options.get("split_heads"):
            raise ValueError(
                "PeriodicRowwiseMuon: split_specs/split_heads are not supported (its RowNorm steps "
                "work on whole matrices); leave them unset for name='prmuon'"
            )
        for key, value in FIXED.items():
            _check_fixed(key, options.get(key, value), "")
        super().__init__(params, lr=lr, **{**NS_DEFAULTS, **options})
        self.defaults.update(own.as_dict())
        for group, cfg in zip(self.param_groups, self._configs):
            for key, value in own.as_dict().items():
                group.setdefault(key, value)
            if cfg is not None:
                group.setdefault(STEP_KEY, 0)
        self._read_groups()
        # RowNorm's orientation and the groups that split each matrix's oriented rows: fixed by
        # the layout, so found once (mesh lookups stay out of the step).
        self._rownorm_layout: dict[int, tuple[int, SplitGroups]] = {}
        for sg in self._groups:
            for m in sg.members:
                row_dim = rownorm_row_dim(m.layout.global_shape)
                self._rownorm_layout[id(m.param)] = (row_dim, split_groups(m.layout, row_dim))

    def _read_groups(self) -> None:
        """Validate every matrix group and cache its PRMuonConfig (after init and after load)."""
        self._prm: list[PRMuonConfig | None] = []
        for i, (group, cfg) in enumerate(zip(self.param_groups, self._configs)):
            if cfg is None:
                self._prm.append(None)
                continue
            for key in FIXED:
                _check_fixed(key, getattr(cfg, key), f"param group {i}: ")
            step = group[STEP_KEY]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"param group {i}: {STEP_KEY}={step!r}: must be an integer >= 0")
            self._prm.append(PRMuonConfig(**{k: group[k] for k in PRMuonConfig.keys()}))

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch replaces each group by the saved one: a checkpoint written by plain Dion3/Muon
        # lacks our keys, so they fall back to the defaults and the period starts at a refresh.
        for group, cfg in zip(self.param_groups, self._configs):
            for key in PRMuonConfig.keys():
                group.setdefault(key, self.defaults[key])
            if cfg is not None:
                group.setdefault(STEP_KEY, 0)
        self._read_groups()

    def is_refresh(self, group_index: int) -> bool:
        """Whether the next step of matrix group ``group_index`` is a full NS refresh."""
        group = self.param_groups[group_index]
        return group[STEP_KEY] % group["refresh_period"] == 0

    # ----------------------------------------------------------------- the step
    def _matrix_steps(self, shape_groups: list[ShapeGroup], moving: MovingGradients | None = None) -> None:
        """Step t of every matrix group: refresh groups run Dion3's pipeline (fraction 1: full
        NS of M_t, then M *= mu), the others one RowNorm pass over all their shape groups
        together, so the split matrices' statistics share one all-reduce. Then t += 1 (on the
        host: a CUDA graph needs one capture per branch and must advance t itself)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # One captured graph would replay one branch forever and never advance t.
            raise NotImplementedError(
                "PeriodicRowwiseMuon cannot be captured in a CUDA graph yet: a refresh step and a "
                "RowNorm step are different graphs and the step counter lives on the host; "
                "disable cuda_graph for name='prmuon'"
            )
        refresh = [sg for sg in shape_groups if self.is_refresh(sg.group_index)]
        rownorm_groups = [sg for sg in shape_groups if not self.is_refresh(sg.group_index)]
        if refresh:
            super()._matrix_steps(refresh, moving)
        if rownorm_groups:
            self._rownorm_step(rownorm_groups)
        for group, cfg in zip(self.param_groups, self._configs):
            if cfg is not None:
                group[STEP_KEY] += 1

    def _rownorm_step(self, shape_groups: list[ShapeGroup]) -> None:
        """One RowNorm step of every matrix in ``shape_groups`` (App. C Alg. 2, lines 8-15).

        Matrices whose oriented rows are split across ranks send their per-row squared sums in
        one packed all-reduce (per process group), started first; the complete-row matrices are
        updated while it is in flight, the split ones after it lands.
        """
        members = [(sg.group_index, m) for sg in shape_groups for m in sg.members]
        self._add_gradients(shape_groups)

        views, splits = [], []
        for _, m in members:
            row_dim, groups = self._rownorm_layout[id(m.param)]
            views.append(orient(to_local(self.state[m.param]["momentum"]), row_dim))
            splits.append(groups)
        # Every split matrix joins the all-reduce, with or without a gradient, so the packed
        # buffer has the same size on every rank.
        cut = [i for i, s in enumerate(splits) if s]
        pending = reduce_row_stats([row_sq_sums(views[i]) for i in cut], [splits[i] for i in cut], self.comm_stats)
        for i, (gi, m) in enumerate(members):
            if not splits[i]:
                self._rownorm_update(gi, m, views[i], row_sq_sums(views[i]))
        for i, sq in zip(cut, pending.wait()):
            gi, m = members[i]
            self._rownorm_update(gi, m, views[i], sq)

    def _rownorm_update(self, gi: int, m: Member, mom: torch.Tensor, sq_sums: torch.Tensor) -> None:
        """W <- (1 - lr wd) W - lr s gamma O^-1(R_eps(M~)) with one rounding, then M~ *= mu.
        ``mom`` is the oriented local momentum (B, R, C), ``sq_sums`` its rows' full sums."""
        if m.param.grad is None:  # as in Dion3: a matrix without a gradient is left untouched
            return
        cfg, prm = self._configs[gi], self._prm[gi]
        direction = rownorm_direction(mom, sq_sums, prm.rownorm_eps)
        weight = orient(to_local(m.param), self._rownorm_layout[id(m.param)][0])
        f = self._step_factors(gi)  # live, and no-ops on a skipped step
        batch, rows = mom.shape[:2]
        every_row = torch.arange(rows, device=mom.device).expand(batch, rows)
        backend = select_backend(cfg.backend, tuple(mom.shape), cfg.compute_dtype, mom.device)
        backend.fused_update(weight, direction, every_row, f.lr * (m.lr_scale * prm.rownorm_gamma), f.decay)
        mom.mul_(f.mu)


def _check_fixed(key: str, value, where: str) -> None:
    if value != FIXED[key]:
        raise ValueError(
            f"{where}{key}={value!r}: PeriodicRowwiseMuon allows only {key}={FIXED[key]!r} ({_WHY_FIXED[key]})"
        )
