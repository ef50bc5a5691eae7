"""The Dion3 optimizer: one pipeline per step over a plan built once at construction.

Each shape group of matrices (``algorithm="dion3"``) runs the paper's stages (Alg. 4, Sec. 7):
accumulate -> select -> pack -> exchange -> orthogonalize -> normalize -> exchange back ->
update. Four of them have two implementations (optim/stages.py: the torch reference and the
GPU row engine); the rest are one module each (selection.py, dist/comm.py, orthogonalize.py).
Groups with ``algorithm="adamw"`` (embeddings, output head, norms, biases) run torch's AdamW
inside the same optimizer. docs/optimizer.md, "How a step flows", walks through it.
"""

import warnings
from collections.abc import Callable, Iterable

import torch
from torch.optim.adamw import adamw

from dion3_titan.dist.comm import CommStats, summed_over_shards
from dion3_titan.dist.layout import describe, to_local, zeros_like_param
from dion3_titan.dist.plan import PlanEntry, PlanSettings, ShapeGroup, build_groups
from dion3_titan.dist.replicas import average_over_replicas
from dion3_titan.kernels import Backend, select_backend
from dion3_titan.kernels.flops import ns_flops
from dion3_titan.kernels.row_engine import KeptViews
from dion3_titan.optim import engine, overlap
from dion3_titan.optim.config import LIVE_KEYS, Dion3Config, check_adamw, fraction_transfer, lr_scale
from dion3_titan.optim.flavors import FLAVORS
from dion3_titan.optim.moving_grads import MovingGradients
from dion3_titan.optim.nonfinite import NonfiniteGuard
from dion3_titan.optim.observe import Observer
from dion3_titan.optim.orthogonalize import NSSettings, ResultCheck, orthogonalize
from dion3_titan.optim.selection import RowSelector, Selection, every_row, is_tall
from dion3_titan.optim.split import split_pieces
from dion3_titan.optim.stages import Aside, Factors, GroupStep, Normalized, Outcome, RowStats, Stages
from dion3_titan.optim.stages_engine import RowEngineStages
from dion3_titan.optim.stages_reference import ReferenceStages

ALGORITHMS = ("dion3", "adamw")
ADAMW_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-8}
# Newton-Schulz's last product flags the matrices whose result is not finite, where the backend
# has such a kernel (Backend.mm_checked), so the result check needs no pass over the result;
# False reads the result instead (an A/B switch: scripts/bench_step.py --settings
# dion3.CHECKED_PRODUCT=False).
CHECKED_PRODUCT = True


def check_adamw_group(group: dict, where: str) -> None:
    """An AdamW param group's lr, betas, eps and weight_decay (ValueError naming the key)."""
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}betas={betas!r}: must be two numbers (beta1, beta2)")
    values = {
        "lr": group["lr"],
        "beta1": betas[0],
        "beta2": betas[1],
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
    }
    check_adamw(values, where, {"beta1": "betas[0]", "beta2": "betas[1]"})


def plan_settings(cfg: Dion3Config) -> PlanSettings:
    """What the megabatch plan reads of a matrix group's settings."""
    return PlanSettings(
        fraction=cfg.fraction,
        selection_scope=cfg.selection_scope,
        megabatch=cfg.megabatch,
        ns_algorithm=cfg.ns_algorithm,
        ns_steps=cfg.ns_steps,
        ns_restarts=cfg.ns_restarts,
        replicate_sync=cfg.replicate_sync,
        replicate_ns=cfg.replicate_ns,
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
            if algo == "adamw":
                check_adamw_group(group, f"param group {i} (algorithm 'adamw'): ")
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
        self.replicate_sync = self._one_value("replicate_sync")
        self.ns_overlap = self._one_value("ns_overlap")
        self._build_plan()
        self._check_replicas()
        self._init_state()

    # ----------------------------------------------------------------- construction
    def _one_value(self, key: str) -> str:
        """A setting of the whole optimizer, which every matrix group must name alike:
        ``replicate_sync`` (FSDP2 syncs gradients, or not, for every parameter), ``nonfinite``
        (a step has one flag for all its gradients) and ``ns_overlap`` (one schedule per step)."""
        values = {getattr(cfg, key) for cfg in self._configs if cfg is not None}
        if len(values) > 1:
            raise ValueError(f"{key}: every matrix param group must use the same value, got {sorted(values)}")
        return values.pop() if values else self.defaults[key]

    def _check_replicas(self) -> None:
        if self.replicate_sync == "compressed" and not any(sg.replicas is not None for sg in self._groups):
            raise ValueError(
                "replicate_sync='compressed' needs matrices replicated over a mesh dim of size > 1 (HSDP: "
                "data_parallel_replicate_degree > 1); these parameters have none: use replicate_sync='gradients'"
            )

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
        self._ns: list[NSSettings | None] = [NSSettings.from_config(cfg) if cfg else None for cfg in self._configs]
        self.selector = RowSelector(self.comm_stats)
        self.nonfinite = NonfiniteGuard(self._one_value("nonfinite"))  # non-finite gradients and NS results
        self._hyper: dict[int, torch.Tensor] = {}  # group index -> device tensor [lr, weight_decay]
        self._hyper_all: torch.Tensor | None = None  # (groups, 2), the storage of those views
        self._hyper_values: list[float] | None = None  # what it holds, to skip redundant copies
        self._state_version = 0
        self.observer = Observer()  # what optimizer metrics read (off unless enabled)
        self.kernel_tables = engine.TableCache()  # the row engine's per-group kernel tables
        self._views: dict[tuple[int, int], tuple] = {}  # (id(group), state_version) -> member views
        self._reference, self._row_engine = ReferenceStages(), RowEngineStages()
        self._overlap = overlap.Overlap()  # the costliest group's stream, made on first use

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

    def state_dict(self) -> dict:
        """torch's state dict. Under compressed sync every replica first replaces its momentum
        by the replicas' mean (a collective: every rank calls it, as checkpointing does): the
        mean is unchanged, so nothing later changes, and the saved momentum is the one a
        gradient-synced run would have, loadable at any replicate degree."""
        if self.replicate_sync == "compressed":
            momenta = {id(m.param): self.state[m.param]["momentum"] for sg in self._groups for m in sg.members}
            average_over_replicas(list(momenta.values()))
        return super().state_dict()

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
        built = [None if cfg is None else cfg.as_dict() for cfg in self._configs]
        super().load_state_dict(state_dict)
        for p, key, value in keep:
            self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
        self._state_version += 1
        self._keep_fixed_settings(built)

    def _keep_fixed_settings(self, built: list[dict | None]) -> None:
        """After a load: the groups keep the settings this optimizer was built with (``built``,
        per group) except LIVE_KEYS, which the checkpoint restores; its plan and kernels are
        built from the others, so a checkpoint's differing value would apply in part. One
        warning names each saved value not taken."""
        ignored = []
        for i, (group, values) in enumerate(zip(self.param_groups, built)):
            if values is None:
                continue
            for key, value in values.items():
                if key not in LIVE_KEYS and key in group and _frozen(group[key]) != _frozen(value):
                    ignored.append(f"group {i} {key}={group[key]!r} (kept {value!r})")
            group.update({k: v for k, v in values.items() if k not in LIVE_KEYS})
            self._configs[i] = Dion3Config(**{k: group[k] for k in Dion3Config.keys()})
        if ignored:
            warnings.warn(
                "Dion3.load_state_dict: the checkpoint's " + ", ".join(ignored) + " not taken: only "
                f"{', '.join(LIVE_KEYS)} come from a checkpoint; the other settings are fixed when the "
                "optimizer is built (its plan is made from them)",
                stacklevel=3,  # the caller of load_state_dict
            )

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

    def use_gradient_norm(self, norm: torch.Tensor) -> None:
        """The next step's gradients have total norm ``norm`` (the trainer's gradient clipping
        computed it): that step takes its non-finite flag from it instead of a pass over every
        gradient. The norm must be the same on every rank and cover every gradient the step
        reads (optim/nonfinite.py); a step without one makes its own pass."""
        self.nonfinite.use_gradient_norm(norm)

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
    def step_body(self, moving: MovingGradients | None = None) -> None:
        """Everything a step does on the device, every state write gated by the gradients'
        ``ok`` flag (optim/nonfinite.py). It never waits on the device, so the same code runs
        eagerly and inside a CUDA-graph capture. ``moving`` (a capture): the gradients read
        through movable tables are registered there (optim/moving_grads.py)."""
        self.nonfinite.check(self._named_grads, self._device())
        if self.replicate_sync == "compressed":  # AdamW's gradients as FSDP2 would have synced them
            grads = [p.grad for g, c in zip(self.param_groups, self._configs) if c is None for p in g["params"]]
            average_over_replicas([g for g in grads if g is not None], self.comm_stats)
        for gi, (group, cfg) in enumerate(zip(self.param_groups, self._configs)):
            if cfg is None:
                self._adamw_step(gi, group)
        self._matrix_steps(self._groups, moving)
        self.nonfinite.publish()

    def _matrix_steps(self, groups: list[ShapeGroup], moving: MovingGradients | None = None) -> None:
        """The matrix pipeline: momentum accumulation, then each shape group from selection to
        update before the next starts, so only one group's Newton-Schulz buffers are alive at a
        time. On one GPU the group of the most NS FLOPs runs its pipeline on a stream of its own,
        beside the others' (optim/overlap.py)."""
        self.observer.count_step(self.nonfinite.ok)
        self.selector.seed(groups, self._configs, self.param_groups)
        factors = {gi: self._step_factors(gi) for gi in dict.fromkeys(sg.group_index for sg in groups)}

        def pipeline(lane: list[ShapeGroup], account: Callable[[Outcome], None], aside: Aside | None = None) -> None:
            steps = [self._group_step(sg) for sg in lane]
            stats = self._accumulate(steps, moving, factors)
            known = {key: s.l1 for key, s in stats.items()}
            scores = self.selector.scores([(g.sg, g.cfg, g.momenta, known.get(id(g.sg))) for g in steps])
            picked = [self._select(g, scores.get(id(g.sg)), factors[g.sg.group_index], aside) for g in steps]
            norms = self._sent_norms(steps, [sel for sel, _ in picked], stats)
            for g, (sel, rest_decayed) in zip(steps, picked):
                key = id(g.sg)
                account(
                    self._step_group(g, sel, rest_decayed, stats.get(key), factors[g.sg.group_index], norms.get(key))
                )

        device = self._device()
        key = (tuple(id(sg) for sg in groups), self._state_version)  # settings change with the state
        lanes = self._overlap.lanes(key, groups, self.ns_cost, device) if self.ns_overlap else None
        if lanes is not None:
            self._overlap.run(lanes, device, pipeline, self._account)
        else:
            pipeline(groups, self._account)

    def ns_cost(self, sg: ShapeGroup) -> float:
        """Newton-Schulz FLOPs of one step of shape group ``sg`` on this rank."""
        cfg = self._configs[sg.group_index]
        return sg.batch * ns_flops(sg.k, sg.cols, cfg.ns_algorithm, cfg.ns_steps, cfg.ns_restarts, symmetric=True)

    def _select(
        self, g: GroupStep, scores: torch.Tensor | None, factors: Factors, aside: Aside | None
    ) -> tuple[Selection, bool]:
        """2. The rows of one shape group to orthogonalize (``scores``: its entry of
        ``RowSelector.scores``, made for all groups at once), and whether the weight decay of
        the rows it leaves out went to ``aside``, which takes work that needs nothing past
        the selection to run beside the rest (optim/overlap.py)."""
        sel = self.selector.select(g.sg, g.cfg, g.momenta, scores)
        stages = self._stages(g.sg)
        rest_decayed = aside is not None and stages.splits_decay(sel, factors)
        if rest_decayed:
            aside(lambda: stages.decay_unselected(g, sel, factors))
        return sel, rest_decayed

    def _sent_norms(
        self, steps: list[GroupStep], sels: list[Selection], stats: dict[int, RowStats]
    ) -> dict[int, torch.Tensor]:
        """By id(group), for the groups whose rows move as Newton-Schulz's input
        (``ShapeGroup.sends_ns_input``): each matrix's sum of squares over all of its selected
        rows, on whichever ranks they are, by which ``pack`` normalizes them. One all-reduce
        per shard group for all the groups of the step."""
        sending = [(g, sel) for g, sel in zip(steps, sels) if g.sg.sends_ns_input]
        parts = [(g.sg.exchange, self._stages(g.sg).selected_sumsq(g, sel, stats.get(id(g.sg)))) for g, sel in sending]
        return {id(g.sg): total for (g, _), total in zip(sending, summed_over_shards(parts, self.comm_stats))}

    def _step_group(
        self,
        g: GroupStep,
        sel: Selection,
        rest_decayed: bool,
        stats: RowStats | None,
        factors: Factors,
        norm_sq: torch.Tensor | None,
    ) -> Outcome:
        """Stages 3-8 of one shape group for the rows ``sel`` (``rest_decayed``: the weight
        decay of the others is done apart); returns what the step's counters take from it.
        ``norm_sq``: the rows move as NS's input, normalized by it (``_sent_norms``)."""
        sg = g.sg
        stages, moves = self._stages(sg), sg.moves_data
        tall = is_tall(sg, g.cfg)
        packed = stages.pack(g, sel, stats, moves, tall, factors, norm_sq)  # 3. pack
        owned, owned_v = packed.x, packed.row_data
        if moves:  # 4. exchange: the rows to their owners, their per-row data beside them
            owned, owned_v = sg.exchange.gather(owned, None if owned_v is None else owned_v.unsqueeze(-1))
            owned_v = None if owned_v is None else owned_v.squeeze(-1)
        backend = select_backend(g.cfg.backend, tuple(owned.shape), g.cfg.compute_dtype, owned.device)
        # 5. orthogonalize
        ortho, flagged = self._orthogonalize(g, owned, backend, tall, packed.normalized, packed.rows)
        ortho, bad, row_sq = self._checked(g, stages, ortho, moves, flagged)
        norm = stages.normalize(g, ortho, owned_v, bad, row_sq)  # 6. normalize (the flavor's)
        mine = self._exchange_back(sg, norm)  # 7. exchange back
        void = bad if stages.voids_in_kernel(moves) else None
        stages.update(g, sel, mine, factors, backend, void, rest_decayed)  # 8. update
        return Outcome(g, sel, mine.rows, mine, factors.lr, void, bad)

    @staticmethod
    def _exchange_back(sg: ShapeGroup, norm: Normalized) -> Normalized:
        """7. This rank's rows (N, selected, C_local) of the owners' normalized results, with
        what goes with each row: the flavor's per-row data and the factors the update applies
        (``den``, and ``scale`` as a column), float32 beside the rows, bit-exact."""
        if not sg.exchange.moves_data:
            return Normalized(norm.rows[:, : sg.selected, : sg.local_cols], norm.row_data, norm.den, norm.scale)
        n, k = norm.rows.shape[:2]
        fields = [norm.row_data, norm.den, None if norm.scale is None else norm.scale[:, None].expand(n, k)]
        extra = [f.float() for f in fields if f is not None]
        rows, got = sg.exchange.scatter(norm.rows, torch.stack(extra, dim=-1) if extra else None)
        parts = iter(() if got is None else got.movedim(-1, 0).contiguous())  # the kernels take unit strides
        data, den, scale = (None if f is None else next(parts) for f in fields)
        rows = rows[:, : sg.selected, : sg.local_cols]
        return Normalized(rows, data, den, None if scale is None else scale[:, 0].contiguous())

    def _account(self, out: Outcome) -> None:
        """The step's counters of one shape group: non-finite NS results, and the metrics."""
        self.nonfinite.count_ns(out.bad)
        self.observer.record(out.g, out.sel, out.result, out.norm, out.lr, out.void)

    def _orthogonalize(
        self, g: GroupStep, owned: torch.Tensor, backend: Backend, tall: bool, normalized: bool, rows: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """polar() of the owned batch, and which of its matrices are not finite where NS's last
        product flagged them (else None). Across HSDP replicas each orthogonalizes its share
        (the replicas' mean under compressed sync) and the results are joined on every replica.
        ``rows``: the batch's real rows where the pack wrote it at the backend's Gram side."""
        replicas = g.sg.replicas
        x = owned if replicas is None else replicas.split(owned)
        # the replicas' shares are joined below: a flag per share would need joining too
        check = ResultCheck() if CHECKED_PRODUCT and replicas is None else None
        ortho = orthogonalize(x, g.ns, backend, tall, normalized, check, rows)
        if replicas is not None:
            return replicas.gather(ortho), None
        return ortho, None if check is None else check.bad

    def _checked(
        self, g: GroupStep, stages: Stages, ortho: torch.Tensor, moves: bool, flagged: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A non-finite NS result is never applied (optim/nonfinite.py): (the result, its
        non-finite matrices, its rows' sums of squares or None). Which matrices: as NS's last
        product flagged them, else from the rows' sums of squares where the stages compute them,
        else by a pass of the check's own; the sums are computed where the flavor reads them
        too. Such a matrix is zeroed, unless the update voids it itself."""
        row_sq = None
        if flagged is None or g.flavor.reads_row_sums:
            row_sq = stages.result_row_sums(g, ortho)
        ortho, bad = self.nonfinite.orthogonalized(ortho, stages.voids_in_kernel(moves), row_sq, flagged)
        return ortho, bad, row_sq

    def _group_step(self, sg: ShapeGroup) -> GroupStep:
        cfg = self._configs[sg.group_index]
        flavor = FLAVORS[cfg.flavor]
        momenta, weights, row_states = self._member_views(sg, flavor)
        return GroupStep(
            sg,
            cfg,
            self._ns[sg.group_index],
            flavor,
            momenta=momenta,
            weights=weights,
            row_states=row_states,
            active=[m.param.grad is not None for m in sg.members],
            guard=self.nonfinite,
            tables=self.kernel_tables,
        )

    def _member_views(self, sg: ShapeGroup, flavor) -> tuple[list, list, list | None]:
        """The members' local views of momentum, weight and per-row state. Kept from step to
        step (per-matrix Python is most of an eager step's host time): they change only when
        the state tensors are replaced, which bumps ``state_version``."""
        key = (id(sg), self._state_version)
        views = self._views.get(key)
        if views is None:
            members = sg.members
            views = (  # kept: the row engine keys its tables by them once (KeptViews)
                KeptViews(m.view(self._momentum(m.param)) for m in members),
                KeptViews(m.view(to_local(m.param)) for m in members),
                KeptViews(flavor.rows_state(self.state[m.param], m) for m in members) if flavor.row_data else None,
            )
            self._views = {k: v for k, v in self._views.items() if k[1] == self._state_version}
            self._views[key] = views
        return views

    def _stages(self, sg: ShapeGroup) -> Stages:
        """The implementation of the stages that serves this shape group."""
        cfg = self._configs[sg.group_index]
        return self._row_engine if engine.runs_on(cfg.backend, sg.members[0].param) else self._reference

    def _momentum(self, param: torch.Tensor) -> torch.Tensor:
        return to_local(self.state[param]["momentum"])

    def _accumulate(
        self, steps: list[GroupStep], moving: MovingGradients | None = None, factors: dict[int, Factors] | None = None
    ) -> dict[int, RowStats]:
        """1. M <- M + G, once per parameter (a split parameter has several members). Groups
        the row engine serves also get their rows' statistics from the same pass, by id(group).
        With ``factors`` (by param group), a group that selects every row may take its error
        feedback in the same pass (mu > 0: the pack divides the rows it reads by mu's share
        of their norm)."""
        feedback = {}
        for g in steps if factors is not None else ():
            f = factors[g.sg.group_index]
            if f.momentum > 0 and every_row(g.sg, g.cfg):
                feedback[id(g.sg)] = f.momentum
        stats: dict[int, RowStats] = {}
        for stages in (self._row_engine, self._reference):
            mine = [g for g in steps if self._stages(g.sg) is stages]
            if mine:
                stats.update(stages.accumulate(mine, self._momentum, moving, feedback))
        return stats

    def _add_gradients(self, groups: list[ShapeGroup]) -> None:
        """M <- M + G for every parameter of ``groups``, with torch ops (no row statistics)."""
        self._reference.accumulate([self._group_step(sg) for sg in groups], self._momentum)

    def _step_factors(self, gi: int) -> Factors:
        """lr, the weight-decay factor 1 - lr' wd and the momentum decay mu of matrix group
        ``gi`` for this step, live device scalars (lr' is the transferred lr,
        ``fraction_transfer``); on a step with a non-finite gradient lr is 0 and both factors
        are exactly 1, so the update leaves weights and momentum as they are."""
        group = self.param_groups[gi]
        lr, wd = self._hyper[gi].unbind()
        lr = self.nonfinite.scale(lr)
        cfg = self._configs[gi]
        transfer = fraction_transfer(cfg.fraction, cfg.fraction_lr_transfer)
        mu = self.nonfinite.factor(group["momentum"])
        return Factors(lr, 1.0 - (lr * transfer) * wd, mu, group["momentum"], decays=group["weight_decay"] != 0)

    def _device(self) -> torch.device:
        return next((to_local(p).device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    # ----------------------------------------------------------------- observability
    def track_selection(self) -> None:
        """Keep, per matrix row, the step it was last selected at (for selection metrics)."""
        self.observer.track_selection(self._groups)

    @property
    def nonfinite_ns_events(self) -> int:
        """Matrices whose Newton-Schulz result was not finite so far (each got no update that
        step). Reading it synchronizes."""
        return self.nonfinite.ns_events

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


def _frozen(value):
    """A setting as compared across a checkpoint (which may hand tuples back as lists)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value
