"""The Dion3 optimizer: one pipeline per step over a plan built once at construction.

Matrix groups (``algorithm="dion3"``) run: accumulate momentum -> select rows -> gather the
selected rows to their owner -> orthogonalize the shape group as one batch (+ NorMuon) ->
scatter back -> fused update with error feedback. Groups with ``algorithm="adamw"`` (embeddings,
output head, norms, biases) run torch's AdamW inside the same optimizer.
"""

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

from dion3_titan.dist.comm import CommStats, full_row_scores
from dion3_titan.dist.layout import describe, to_local, zeros_like_param
from dion3_titan.dist.plan import Member, PlanEntry, PlanSettings, ShapeGroup, build_groups
from dion3_titan.kernels import Backend, select_backend
from dion3_titan.optim import engine
from dion3_titan.optim.config import Dion3Config, fraction_transfer, lr_scale
from dion3_titan.optim.flavors import FLAVORS
from dion3_titan.optim.nonfinite import NonfiniteGuard
from dion3_titan.optim.orthogonalize import NSSettings, is_transposed_batch, normalize_batch, orthogonalize
from dion3_titan.optim.routing import param_class
from dion3_titan.optim.split import split_pieces
from dion3_titan.optim.update import (
    apply_update,
    l1_scores,
    take_rows,
    top_rows,
    top_rows_global,
)

ALGORITHMS = ("dion3", "adamw")


@dataclass
class _GroupWork:
    """One shape group in flight between orthogonalization and update."""

    sg: ShapeGroup
    cfg: Dion3Config
    views: list[torch.Tensor]
    rows: torch.Tensor  # (N, selected) row indices into each member's view
    rows_per: tuple[torch.Tensor, ...]
    valid: torch.Tensor | None
    owned_v: torch.Tensor | None
    ortho: torch.Tensor
    backend: Backend
    every_row: bool  # f = 1: rows are all of them, in order
    fused: bool  # the row engine runs this group's passes (optim/engine.py)
    void: torch.Tensor | None = None  # (N,) matrices whose NS result is taken as zero


ADAMW_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-8}


def _join(views: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate (B, R, C) views along the batch. Views that select W's columns are
    transposed views of contiguous tensors: join those in their own memory order (a coalesced
    copy, not a strided one) and hand back the same transposed view."""
    if is_transposed_batch(views):
        return torch.cat([v.mT for v in views]).mT
    return torch.cat(views)


def plan_settings(cfg: Dion3Config) -> PlanSettings:
    """What the megabatch plan reads of a matrix group's settings."""
    return PlanSettings(
        fraction=cfg.fraction,
        selection_scope=cfg.selection_scope,
        megabatch=cfg.megabatch,
        row_data=FLAVORS[cfg.flavor].row_data,
        ns_algorithm=cfg.ns_algorithm,
        ns_steps=cfg.ns_steps,
        ns_restarts=cfg.ns_restarts,
    )


class Dion3(torch.optim.Optimizer):
    """Dion3 (Muon/NorMuon flavors, f in (0, 1]) for matrices and AdamW for the rest.

    Keyword names match ``Dion3Config`` and the ``[optimizer]`` TOML keys. Param groups may
    override any of them and carry ``algorithm`` ("dion3" default, or "adamw" with ``betas``,
    ``eps``, ``weight_decay``) and ``names`` (parameter names, for messages and metrics).
    """

    def __init__(self, params: Iterable, lr: float = 0.02, **options) -> None:
        unknown = set(options) - set(Dion3Config.keys()) - {"betas", "eps"}
        if unknown:
            raise ValueError(f"Dion3: unknown option(s) {sorted(unknown)}; allowed are {sorted(Dion3Config.keys())}")
        adamw_opts = {k: options.pop(k, v) for k, v in ADAMW_DEFAULTS.items()}
        config = Dion3Config(lr=lr, **options)
        defaults = {**config.as_dict(), **adamw_opts, "algorithm": "dion3"}
        self._configs = None
        super().__init__(params, defaults)
        self._configs: list[Dion3Config | None] = []
        for i, group in enumerate(self.param_groups):
            algo = group["algorithm"]
            if algo not in ALGORITHMS:
                raise ValueError(f"param group {i}: algorithm={algo!r}: allowed values are {ALGORITHMS}")
            cfg = None
            if algo == "dion3":
                cfg = Dion3Config(**{k: group[k] for k in Dion3Config.keys()})
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(
                            f"param group {i} (algorithm 'dion3') holds a {p.ndim}D parameter of shape "
                            f"{tuple(p.shape)}; only 2D matrices and 3D stacks of matrices can be "
                            "orthogonalized: put it in an algorithm='adamw' group"
                        )
            self._configs.append(cfg)
        self._build_plan()
        self._init_state()

    # ----------------------------------------------------------------- construction
    def _names(self, group: dict) -> list[str]:
        names = group.get("names")
        return list(names) if names else [f"param{j}" for j in range(len(group["params"]))]

    def _build_plan(self) -> None:
        entries = []
        for gi, group in enumerate(self.param_groups):
            cfg = self._configs[gi]
            if cfg is None:
                continue
            for p, name in zip(group["params"], self._names(group)):
                pieces = split_pieces(name, tuple(p.shape), cfg)  # fused weights (optim/split.py)
                layouts = (
                    [describe(p, cfg.selection_dim)]
                    if pieces is None
                    else [describe(p, cfg.selection_dim, pc, name) for pc in pieces]
                )
                for i, layout in enumerate(layouts):
                    scale = lr_scale(layout.d_out, layout.d_in, cfg.lr_rule, cfg.fraction, cfg.fraction_lr_transfer)
                    entries.append(PlanEntry(gi, p, name, layout, scale, None if pieces is None else i))
        self.comm_stats = CommStats()
        self._groups: list[ShapeGroup] = build_groups(
            entries, [plan_settings(cfg) if cfg else None for cfg in self._configs], self.comm_stats
        )
        self._ns: list[NSSettings | None] = [
            NSSettings(cfg.ns_algorithm, cfg.coefficients(), cfg.ns_restarts, cfg.compute_dtype, cfg.ns_eps)
            if cfg
            else None
            for cfg in self._configs
        ]
        self._rngs: dict[int, torch.Generator] = {}  # param group -> random selection
        self._random_seeds: dict[int, int] = {}  # param group -> this step's base seed
        self.nonfinite = NonfiniteGuard(self.defaults["nonfinite"])  # non-finite gradients and NS results
        self._hyper: dict[int, torch.Tensor] = {}  # group index -> device tensor [lr, weight_decay]
        self._hyper_all: torch.Tensor | None = None  # (groups, 2), the storage of those views
        self._hyper_values: list[float] | None = None  # what it holds, to skip redundant copies
        self._state_version = 0
        # observability (dion3_titan/optimizer_metrics.py): off unless enabled; no host syncs in the step
        self._last_selected: dict[int, torch.Tensor] | None = None  # member id -> (B, R) step
        self._step_t: torch.Tensor | None = None
        self.measure_updates = False  # set on logging steps: accumulate update sums of squares
        self.update_sumsq: dict[str, torch.Tensor] = {}
        self.update_numel: dict[str, int] = {}
        self._device_consts: dict[tuple, torch.Tensor] = {}  # made once, read by captured steps
        self.kernel_tables = engine.TableCache()  # the row engine's per-group kernel tables

    def _init_state(self) -> None:
        """Every state tensor exists from construction on, identically on every rank (DCP)."""
        for sg in self._groups:
            cfg = self._configs[sg.group_index]
            for m in sg.members:
                st = self.state[m.param]
                if "momentum" not in st:  # one per parameter, shared by its pieces
                    st["momentum"] = zeros_like_param(m.param)
                FLAVORS[cfg.flavor].create_state(st, m)
        for group, cfg in zip(self.param_groups, self._configs):
            if cfg is not None:
                continue
            for p in group["params"]:
                st = self.state[p]
                # on the parameter's device so the step can run inside a CUDA graph
                st["step"] = torch.zeros((), dtype=torch.float32, device=to_local(p).device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @property
    def shape_groups(self) -> tuple[ShapeGroup, ...]:
        """The megabatch plan (dist/plan.py): every shape group of the matrix param groups."""
        return tuple(self._groups)

    @property
    def configs(self) -> tuple[Dion3Config | None, ...]:
        """Each param group's validated settings (None for an AdamW group)."""
        return tuple(self._configs)

    @property
    def state_version(self) -> int:
        """Bumped whenever state tensors or param groups are replaced (a captured step must
        then be captured again)."""
        return self._state_version

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_configs", None) is not None:
            raise ValueError(
                "Dion3 builds its megabatch plan at construction; pass every param group to the constructor"
            )
        super().add_param_group(param_group)

    def param_names(self, group: dict) -> list[str]:
        return self._names(group)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state tensor to its parameter's dtype; NorMuon's second
        # moment must stay float32 (bf16 loses it, and the float32 scatter into it fails).
        var_keys: dict[int, set[str]] = {}  # a split parameter may have several (plan.Member.variance_key)
        for sg in self._groups:
            for m in sg.members:
                var_keys.setdefault(id(m.param), set()).add(m.variance_key)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        mine = [p for g in self.param_groups for p in g["params"]]
        keep = []
        for sid, p in zip(saved_ids, mine):
            saved = state_dict["state"].get(sid, {})
            keep += [(p, key, saved[key]) for key in var_keys.get(id(p), ()) if torch.is_tensor(saved.get(key))]
        super().load_state_dict(state_dict)
        for p, key, value in keep:
            self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
        self._state_version += 1
        for i, group in enumerate(self.param_groups):
            if self._configs[i] is not None:
                self._configs[i] = Dion3Config(**{k: group[k] for k in Dion3Config.keys()})

    # ----------------------------------------------------------------- the step
    # Host-side counters a step advances in its param groups (rolled back when it is skipped).
    HOST_COUNTERS: tuple[str, ...] = ("selection_step",)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.nonfinite.resolve()  # the previous step's flags: count a skipped step, or raise
        counters = [{k: g.get(k) for k in self.HOST_COUNTERS} for g in self.param_groups]
        self.load_hyperparameters()
        self.step_body()
        self.nonfinite.issued(undo=lambda: self._restore_counters(counters))
        return loss

    def _restore_counters(self, counters: list[dict]) -> None:
        for group, saved in zip(self.param_groups, counters):
            for key, value in saved.items():
                if value is None:
                    group.pop(key, None)
                else:
                    group[key] = value

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (``nonfinite = "skip"``); may synchronize."""
        return self.nonfinite.skipped_steps

    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (name, grad)
            for g in self.param_groups
            for p, name in zip(g["params"], self._names(g))
            if p.grad is not None and (grad := to_local(p.grad)).numel()
        ]

    def load_hyperparameters(self) -> None:
        """Copy each group's lr and weight decay into its device tensors. Kept out of
        ``step_body`` so a captured step reads live values (LR schedules keep working)."""
        values = [float(v) for g in self.param_groups for v in (g["lr"], g["weight_decay"])]
        if values == self._hyper_values:
            return  # unchanged: no copy (host time of a replayed step)
        if self._hyper_all is None:
            device = next((to_local(p).device for g in self.param_groups for p in g["params"]), None)
            self._hyper_all = torch.zeros(len(self.param_groups), 2, dtype=torch.float32, device=device)
            self._hyper = dict(enumerate(self._hyper_all))  # views: captured steps read them live
        # One copy for every group; from a fresh pageable tensor, so it may be non-blocking.
        self._hyper_all.copy_(torch.tensor(values, dtype=torch.float32).view(-1, 2), non_blocking=True)
        self._hyper_values = values

    @torch.no_grad()
    def step_body(self) -> None:
        """Everything a step does on the device, every state write gated by the gradients'
        ``ok`` flag (optim/nonfinite.py). It never waits on the device, so the same code runs
        eagerly and inside a CUDA-graph capture."""
        self.nonfinite.check(self._named_grads(), self._device())
        for gi, (group, cfg) in enumerate(zip(self.param_groups, self._configs)):
            if cfg is None:
                self._adamw_step(gi, group)
        self._matrix_steps(self._groups)
        self.nonfinite.publish()

    def _matrix_steps(self, groups: list[ShapeGroup]) -> None:
        """The matrix pipeline: momentum accumulation for every group, then each shape group
        from selection to update before the next starts, so only one group's Newton-Schulz
        buffers are alive at a time."""
        if self._step_t is not None:
            self._step_t += self.nonfinite.ok.to(torch.int64)
        self._seed_random_selection(groups)
        scores = self._accumulate(groups)
        for sg in groups:
            work = self._orthogonalize_group(sg, scores.get(id(sg)))
            self._check_result(work)
            self._update_group(work)

    def _accumulate(self, groups: list[ShapeGroup]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """1. M <- M + G, once per parameter (a split parameter has several members). Groups
        the row engine serves also get their rows' l1 norms and sums of squares (N, R) from
        the same pass, returned by id(group)."""
        scores: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        fused = [sg for sg in groups if self._fused(sg)]
        for sg in fused:
            l1 = torch.empty(sg.batch, sg.local_rows, dtype=torch.float32, device=to_local(sg.members[0].param).device)
            scores[id(sg)] = (l1, torch.empty_like(l1))
        if fused:
            engine.accumulate(
                [(sg.members, *scores[id(sg)]) for sg in fused],
                lambda p: to_local(self.state[p]["momentum"]),
                lambda p: None if p.grad is None else to_local(p.grad),
                self.nonfinite,
                self.kernel_tables,
            )
        done = {id(m.param) for sg in fused for m in sg.members}
        self._add_gradients([m for sg in groups for m in sg.members], done=done)
        return scores

    def _add_gradients(self, members: list[Member], done: set[int] = frozenset()) -> None:
        """M <- M + G (gated by the gradients' ``ok`` flag) for the parameter of each member that
        has a gradient, once per parameter (a split parameter has several members); parameters
        whose id is in ``done`` were accumulated by the row engine."""
        seen, moms, grads = set(done), [], []
        for m in members:
            if m.param.grad is not None and id(m.param) not in seen:
                seen.add(id(m.param))
                moms.append(to_local(self.state[m.param]["momentum"]))
                grads.append(to_local(m.param.grad))
        self.nonfinite.accumulate(moms, grads)

    def _fused(self, sg: ShapeGroup) -> bool:
        """Whether the row engine runs this group's memory-bound passes."""
        return engine.runs_on(self._configs[sg.group_index].backend, sg.members[0].param)

    def _orthogonalize_group(
        self, sg: ShapeGroup, scores: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> "_GroupWork":
        """2-4: select this rank's rows, pack them, gather them to their owners, orthogonalize.
        ``scores``: the row engine's (l1, sum of squares) per row, when it serves the group."""
        cfg = self._configs[sg.group_index]
        members = sg.members
        views = [m.view(to_local(self.state[m.param]["momentum"])) for m in members]
        every_row = self._every_row(sg, cfg)
        if every_row:
            rows, valid = self._all_rows(sg, views[0].device), None
        else:
            rows, valid = self._select(sg, cfg, views, None if scores is None else scores[0])

        sel, k, cols = sg.selected, sg.k, sg.cols
        rows_per = rows.split([m.layout.batch for m in members])
        send_v = None
        flavor = FLAVORS[cfg.flavor]
        if flavor.row_data:  # the flavor's per-row state travels with the rows
            states = [flavor.rows_state(self.state[m.param], m) for m in members]
            if scores is not None:
                send_v = engine.gather_row_state(states, rows, k, self.kernel_tables)
            else:
                send_v = torch.nn.functional.pad(torch.cat(states).gather(1, rows), (0, k - sel))
        ns = self._ns[sg.group_index]
        whole = every_row and not sg.exchange.moves_data and cols == sg.local_cols and k == sel
        # orient by the real (unpadded) selected shape, see orthogonalize()
        real_rows = sg.global_k if cfg.selection_scope == "global" else sum(min(sg.k, r) for r in sg.block_rows)
        tall = real_rows > members[0].layout.global_cols
        if scores is not None:
            backend = select_backend(cfg.backend, (sg.batch, k, cols), cfg.compute_dtype, views[0].device)
            side = k if tall else backend.gram_side(k)
            owned, owned_v, normalized = self._pack_fused(sg, views, rows, valid, scores[1], send_v, every_row, side)
        elif whole and all(m.param.grad is not None for m in members):
            # The whole momentum stays here: normalize it straight into the NS batch (one
            # pass over each matrix instead of a float32 copy, its norm, a division and a cast).
            owned, owned_v, normalized = normalize_batch(views, ns.eps, ns.dtype), send_v, True
        else:
            # pack the selected rows (zero-padded to the group's fixed block)
            send = _join(views) if every_row else torch.cat([take_rows(v, r) for v, r in zip(views, rows_per)])
            for m in members:
                if m.param.grad is None:  # no gradient: contributes nothing, receives no update
                    send[m.offset : m.offset + m.layout.batch] = 0
            if valid is not None:
                send = send * valid.unsqueeze(-1).to(send.dtype)
            if cols > sg.local_cols or k > sel:  # (pad copies even when it adds nothing)
                send = torch.nn.functional.pad(send, (0, cols - sg.local_cols, 0, k - sel))
            (owned, owned_v), normalized = sg.exchange.gather(send, send_v), False
        backend = select_backend(cfg.backend, tuple(owned.shape), cfg.compute_dtype, owned.device)
        ortho = orthogonalize(owned, ns, backend, tall, normalized)
        if ortho.shape[1] > k and not sg.exchange.moves_data:  # rows packed at the backend's Gram side
            ortho = ortho[:, :k]
        fused = scores is not None
        return _GroupWork(sg, cfg, views, rows, rows_per, valid, owned_v, ortho, backend, every_row, fused)

    def _pack_fused(self, sg, views, rows, valid, sq, send_v, every_row, side):
        """The row engine's 2-3: selected rows straight into the NS batch of ``side`` rows (zero
        rows past k), normalized and cast (nothing moves), or into the zero-padded send buffer
        (the owner normalizes)."""
        ns = self._ns[sg.group_index]
        rows = None if every_row else rows
        active = [m.param.grad is not None for m in sg.members]
        if not sg.exchange.moves_data and sg.cols == sg.local_cols and sg.k == sg.selected:
            transposed = every_row and is_transposed_batch(views)
            shape = (sg.batch, side, sg.cols)
            owned = engine.pack(views, rows, valid, active, shape, ns.dtype, sq, ns.eps, transposed, self.kernel_tables)
            return owned, send_v, True
        shape = (sg.batch, sg.k, sg.cols)
        send = engine.pack(views, rows, valid, active, shape, views[0].dtype, tables=self.kernel_tables)
        owned, owned_v = sg.exchange.gather(send, send_v)
        return owned, owned_v, False

    def _check_result(self, w: "_GroupWork") -> None:
        """A non-finite NS result is never applied (optim/nonfinite.py). Where the row engine
        updates in place, the update kernel voids those matrices itself (no pass over the
        batch)."""
        in_kernel = w.fused and not w.sg.exchange.moves_data
        w.ortho, bad = self.nonfinite.orthogonalized(w.ortho, void_in_kernel=in_kernel)
        if in_kernel:
            w.void = bad

    def _update_group(self, w: "_GroupWork") -> None:
        """5-6: the flavor's normalization on the owner, scatter back, then the fused update with
        error feedback."""
        sg, cfg, members = w.sg, w.cfg, w.sg.members
        flavor = FLAVORS[cfg.flavor]
        ortho, owned_v = w.ortho, w.owned_v
        cols = members[0].layout.global_cols
        if w.fused and not sg.exchange.moves_data:  # the update kernel applies it (epilogue)
            den, scale, owned_v = flavor.epilogue(ortho, owned_v, cfg, cols, w.void)
        else:
            den = scale = None
            ortho, owned_v = flavor.normalize(ortho, owned_v, cfg, cols)
        result, result_v = sg.exchange.scatter(ortho, owned_v)
        result = result[:, : sg.selected, : sg.local_cols]

        lr, decay, mu = self._step_factors(sg.group_index)
        if w.fused:
            self._update_fused(w, result, result_v, den, scale, lr, decay)
        else:
            self._update_members(w, result, result_v, lr, decay, mu)
        if self._last_selected is not None or self.measure_updates:
            self._observe(w, result, den, scale, lr)

    def _update_fused(self, w, result, result_v, den, scale, lr, decay) -> None:
        """6 on the row engine: the whole group's update, error feedback, NorMuon epilogue and
        new per-row state in one launch (``ok``: a step with a non-finite gradient leaves
        weights, momentum and state as they are)."""
        sg, members = w.sg, w.sg.members
        flavor = FLAVORS[w.cfg.flavor]
        slot = None if w.every_row else engine.slots(w.rows, w.valid, sg.local_rows)
        row_state = None
        if flavor.row_data:
            states = [flavor.rows_state(self.state[m.param], m) for m in members]
            row_state = engine.RowState(states, result_v[:, : sg.selected].float())
        engine.update(
            [m.view(to_local(m.param)) for m in members],
            w.views,
            result,
            slot,
            lr,
            decay,
            self.param_groups[sg.group_index]["momentum"],
            [m.lr_scale for m in members],
            None if den is None else den[:, : sg.selected],
            scale,
            ok=self.nonfinite.ok,
            void=w.void,
            row_state=row_state,
            active=[m.param.grad is not None for m in members],
            tables=self.kernel_tables,
        )

    def _update_members(self, w, result, result_v, lr, decay, mu) -> None:
        """6 on the reference path: each member's update with error feedback, then its
        per-row state written back."""
        members = w.sg.members
        flavor = FLAVORS[w.cfg.flavor]
        valid_per = w.valid.split([m.layout.batch for m in members]) if w.valid is not None else None
        for i, m in enumerate(members):
            if m.param.grad is None:
                continue
            sl = slice(m.offset, m.offset + m.layout.batch)
            ok = valid_per[i] if valid_per is not None else None
            apply_update(
                m.view(to_local(m.param)),
                w.views[i],
                result[sl],
                w.rows_per[i],
                ok,
                lr * m.lr_scale,
                decay,
                mu,
                w.backend,
                every_row=w.every_row,
            )
            if flavor.row_data:
                v_state = flavor.rows_state(self.state[m.param], m)
                v_new, v_old = result_v[sl, : w.sg.selected].float(), v_state.gather(1, w.rows_per[i])
                if ok is not None:
                    v_new = torch.where(ok, v_new, v_old)
                v_state.scatter_(1, w.rows_per[i], self.nonfinite.keep(v_new, v_old))

    def _observe(self, w, result, den, scale, lr) -> None:
        """Selection stamps and update sums of squares of each member that got an update (only
        when metrics ask for them)."""
        members = w.sg.members
        valid_per = w.valid.split([m.layout.batch for m in members]) if w.valid is not None else None
        sel = w.sg.selected
        for i, m in enumerate(members):
            if m.param.grad is None:
                continue
            sl = slice(m.offset, m.offset + m.layout.batch)
            ok = valid_per[i] if valid_per is not None else None
            if self._last_selected is not None:
                stamp, old = self._step_t.expand_as(w.rows_per[i]), self._last_selected[id(m)].gather(1, w.rows_per[i])
                if ok is not None:
                    stamp = torch.where(ok, stamp, old)
                self._last_selected[id(m)].scatter_(1, w.rows_per[i], self.nonfinite.keep(stamp, old))
            if self.measure_updates:
                applied = result[sl].float()
                if den is not None:
                    applied = applied / den[sl, :sel, None] * scale[sl, None, None]
                if w.void is not None:
                    applied = torch.where(w.void[sl, None, None], 0.0, applied)
                self._add_update_sumsq(m.name, (lr * m.lr_scale) * applied, m.layout)

    def _step_factors(self, gi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lr, weight-decay factor 1 - lr' wd, momentum decay mu) of matrix group ``gi`` for this
        step, live device scalars (lr' is the transferred lr, ``fraction_transfer``); on a step
        with a non-finite gradient lr is 0 and both factors are exactly 1, so the update leaves
        weights and momentum as they are."""
        group = self.param_groups[gi]
        lr, wd = self._hyper[gi].unbind()
        lr = self.nonfinite.scale(lr)
        transfer = fraction_transfer(group["fraction"], group["fraction_lr_transfer"])
        return lr, 1.0 - (lr * transfer) * wd, self.nonfinite.factor(group["momentum"])

    def _device(self) -> torch.device:
        return next((to_local(p).device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    # ----------------------------------------------------------------- observability
    def track_selection(self) -> None:
        """Keep, per matrix row, the step it was last selected at (for selection metrics)."""
        if self._last_selected is not None:
            return
        device = next((to_local(m.param).device for sg in self._groups for m in sg.members), torch.device("cpu"))
        self._step_t = torch.zeros((), dtype=torch.int64, device=device)
        self._last_selected = {
            id(m): torch.zeros(m.layout.batch, m.layout.local_rows, dtype=torch.int64, device=to_local(m.param).device)
            for sg in self._groups
            for m in sg.members
        }

    def selection_stats(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(share of this rank's rows selected within the last ``window`` steps, age in steps
        of the longest-unselected row), as device scalars."""
        if not self._last_selected:
            zero = torch.zeros(())
            return zero, zero
        last = torch.cat([t.flatten() for t in self._last_selected.values()])
        ages = self._step_t - last  # a never-selected row (stamp 0) is as old as the tracking
        return ((ages < window) & (last > 0)).float().mean(), ages.max()

    def _add_update_sumsq(self, name: str, update: torch.Tensor, layout) -> None:
        cls = param_class(name)
        value = update.square().sum()
        self.update_sumsq[cls] = self.update_sumsq.get(cls, 0) + value
        # every row decays, only the selected ones move: RMS over the whole matrix
        self.update_numel[cls] = self.update_numel.get(cls, 0) + layout.batch * layout.local_rows * layout.local_cols

    @staticmethod
    def _every_row(sg: ShapeGroup, cfg: Dion3Config) -> bool:
        """True when selection would pick every local row (f = 1): then there is nothing to
        score or gather (and no score collective under column sharding)."""
        if sg.selected < sg.local_rows:
            return False
        return cfg.selection_scope == "local" or sg.global_k >= sum(sg.block_rows)

    def _all_rows(self, sg: ShapeGroup, device: torch.device) -> torch.Tensor:
        key = ("all_rows", id(sg))
        if key not in self._device_consts:
            self._device_consts[key] = torch.arange(sg.local_rows, device=device).expand(sg.batch, -1)
        return self._device_consts[key]

    def _select(
        self, sg: ShapeGroup, cfg: Dion3Config, views: list[torch.Tensor], l1: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row indices (N, selected) into each local (B, R, C) view, and for global scope a
        mask of which are really selected. ``l1``: the rows' l1 norms when already known."""
        device = views[0].device
        n_rb, r_max = len(sg.block_rows), max(sg.block_rows)
        if cfg.selection == "random":  # same draws on every rank: a global score table
            scores = self._random_scores(sg, (sg.batch, n_rb, r_max), device)
        else:
            local = l1 if l1 is not None else torch.cat([l1_scores(v) for v in views])
            if sg.col_blocks > 1 or (cfg.selection_scope == "global" and n_rb > 1):
                local = torch.nn.functional.pad(local, (0, r_max - sg.local_rows))
                scores = full_row_scores(sg.exchange, local, self.comm_stats)
            else:
                return top_rows(local, sg.selected), None
        if cfg.selection_scope == "global":
            key = ("block_rows", id(sg))
            if key not in self._device_consts:
                self._device_consts[key] = torch.tensor(sg.block_rows, device=device)
            block_rows = self._device_consts[key]
            return top_rows_global(scores, block_rows, sg.row_block, sg.local_rows, sg.global_k, sg.selected)
        return top_rows(scores[:, sg.row_block, : sg.local_rows], sg.selected), None

    @property
    def nonfinite_ns_events(self) -> int:
        """Matrices whose Newton-Schulz result was not finite so far (each got no update that
        step). Reading it synchronizes."""
        return self.nonfinite.ns_events

    def _seed_random_selection(self, groups: list[ShapeGroup]) -> None:
        """``selection = "random"``: each step's draws come from a generator seeded by (seed,
        step), the step counted in the param group, so a resumed run draws what the
        uninterrupted one would have (param groups are checkpointed)."""
        for gi in sorted({sg.group_index for sg in groups}):
            cfg, group = self._configs[gi], self.param_groups[gi]
            if cfg.selection != "random":
                continue
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    "selection='random' cannot run inside a captured CUDA graph (its seed changes "
                    "every step); use selection='l1' or cuda_graph=false"
                )
            step = group.setdefault("selection_step", 0)
            device = to_local(group["params"][0]).device
            gen = self._rngs.get(gi)
            if gen is None or gen.device != device:
                self._rngs[gi] = torch.Generator(device=device)
            self._random_seeds[gi] = cfg.seed * 1_000_003 + step
            group["selection_step"] = step + 1

    def _random_scores(self, sg: ShapeGroup, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """This step's random scores of one shape group. Each group draws from its own seed
        (the step's seed and the group's key), so every rank draws the same table for it even
        where an earlier group's local batch differs between ranks (an unevenly sharded stack)."""
        gen = self._rngs[sg.group_index]
        gen.manual_seed(self._random_seeds[sg.group_index] + zlib.crc32(repr(sg.key).encode()))
        return torch.rand(shape, device=device, generator=gen)

    def _adamw_step(self, gi: int, group: dict) -> None:
        """torch's fused AdamW on the local tensors (elementwise, so shards need no
        communication); its ``found_inf`` skips the whole step, step counter included, when a
        gradient is not finite."""
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            # elementwise: the local shards are the whole computation (and torch's fused kernel
            # takes them whatever the placements)
            params.append(to_local(p))
            grads.append(to_local(p.grad))
            avgs.append(to_local(st["exp_avg"]))
            sqs.append(to_local(st["exp_avg_sq"]))
            steps.append(st["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            avgs,
            sqs,
            [],
            steps,
            fused=True,
            found_inf=self.nonfinite.found_inf(),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=self._hyper[gi][0],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
