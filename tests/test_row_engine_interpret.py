"""The row engine's kernels (kernels/row_engine/, optim/engine.py) against the torch path, on
CPU through Triton's interpreter.

As in test_kernels_interpret.py, the checks run in one child process that imports Triton with
TRITON_INTERPRET=1 and prints a JSON line per check. Inputs are fresh random draws each run (the
seed is printed with every result); views cover row-major, transposed (column selection),
strided pieces and 3D stacks, ragged row counts and zero padding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- child process (interpreter)
def _views(dtype, B: int, R: int, C: int):
    """name -> (B, R, C) view of a fresh tensor, in the layouts the optimizer hands the engine."""
    import torch

    return {
        "rowmajor": torch.randn(B, R, C).to(dtype),
        "transposed": torch.randn(B, C, R).to(dtype).mT,  # selection along columns
        "piece": torch.randn(B, 2 * R, C).to(dtype)[:, 1::2, :],  # strided row slice
    }


def _run_checks(seed: int, device: str = "cpu") -> list[dict]:
    """Every check on ``device`` (tests/gpu/test_row_engine_gpu.py runs them on a GPU)."""
    import torch

    torch.set_default_device(device)
    try:
        return _checks(seed)
    finally:
        torch.set_default_device(None)


def _checks(seed: int) -> list[dict]:
    import torch

    from dion3_titan.kernels import row_engine as rk
    from dion3_titan.kernels.torch_ops import _fused_update_reference
    from dion3_titan.optim import engine
    from dion3_titan.optim.update import l1_scores, normuon_normalize, take_rows

    torch.manual_seed(seed)
    out: list[dict] = []

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    # (a) accumulate + score
    for dtype in (torch.float32, torch.bfloat16):
        for B, R, C in [(1, 37, 300), (3, 5, 1100), (2, 64, 48)]:
            for layout, m in _views(dtype, B, R, C).items():
                # mu: the error feedback of a selection of every row, in the same pass
                for with_g, mu in ((True, None), (False, None), (True, 0.95)):
                    g = torch.randn(B, R, C).to(dtype) if with_g else None
                    ref = m.clone()
                    if g is not None:
                        torch._foreach_add_([ref], [g])
                    summed = ref.clone()  # what the scores describe
                    if mu is not None:
                        ref.mul_(mu)  # the reference's error feedback, a second rounding
                    l1 = torch.full((B, R), float("nan"))
                    sq = torch.full((B, R), float("nan"))
                    rk.accumulate_scores(m, g, l1, sq, mu=mu)
                    out.append(
                        {
                            "check": "accumulate",
                            "case": f"{dtype},{B}x{R}x{C},{layout},g={with_g},mu={mu}",
                            "bitwise": bool(torch.equal(m, ref)),
                            "l1_err": rel(l1, l1_scores(summed)),
                            "sq_err": rel(sq, summed.double().square().sum(-1)),
                        }
                    )

    # (b) gather + normalize + cast, into a poisoned (N, K, C_out) buffer
    for B, R, C, K, C_out in [(2, 37, 300, 11, 300), (3, 16, 40, 6, 48), (1, 9, 130, 9, 130)]:
        for layout, m in _views(torch.float32, B, R, C).items():
            for mode in ("rows", "rows+keep", "every", "inactive"):
                n = R if mode == "every" else max(1, K - 2)  # ragged: fewer rows than K
                rows = None if mode == "every" else torch.stack([torch.randperm(R)[:n].sort().values for _ in range(B)])
                keep = torch.rand(B, n) > 0.3 if mode == "rows+keep" else None
                den = torch.rand(B) + 0.5
                dest_t = layout == "transposed" and mode == "every"
                K_eff = max(K, n)
                dest = (
                    torch.full((B, C_out, K_eff), float("nan")).half().mT
                    if dest_t
                    else torch.full((B, K_eff, C_out), float("nan")).half()
                )
                rk.gather_rows(m, rows, dest, keep=keep, denominator=den, active=mode != "inactive")
                picked = m if rows is None else take_rows(m, rows)
                if keep is not None:
                    picked = picked * keep.unsqueeze(-1)
                if mode == "inactive":
                    picked = torch.zeros_like(picked)
                padded = torch.nn.functional.pad(picked, (0, C_out - C, 0, K_eff - n))
                ref = torch.div(padded, den[:, None, None], out=torch.empty_like(padded, dtype=torch.float16))
                out.append(
                    {
                        "check": "gather",
                        "case": f"{B}x{R}x{C}->{K_eff}x{C_out},{layout},{mode}",
                        "bitwise": bool(torch.equal(dest, ref)),
                        "finite": bool(torch.isfinite(dest).all()),
                    }
                )

    # engine.pack's normalization: the reference's x / (||x||_F + eps), from the row sums
    for layout, m in _views(torch.float32, 2, 30, 64).items():
        l1, sq = torch.empty(2, 30), torch.empty(2, 30)
        rk.accumulate_scores(m, None, l1, sq)
        rows = [torch.stack([torch.randperm(30)[:8].sort().values]) for _ in range(2)]
        views = [m[:1], m[1:]]
        got = engine.pack(views, torch.cat(rows), None, [True, True], (2, 8, 64), torch.float16, sq, 1e-7)
        sel = torch.cat([take_rows(v, r) for v, r in zip(views, rows)])
        ref = sel / (torch.linalg.vector_norm(sel, dim=(-2, -1), keepdim=True) + 1e-7)
        out.append({"check": "pack_norm", "case": layout, "err": rel(got, ref)})

    # (a') a captured launch pointed at moved gradients (optim/moving_grads.py): the same
    # launch arguments, the table rewritten, reads the new gradients and then the old again
    for layout in ("rowmajor", "transposed", "piece"):
        ms = [_views(torch.float32, 2, 9, 70)[layout], _views(torch.float32, 1, 9, 70)[layout]]
        first = [_views(torch.float32, 2, 9, 70)[layout], _views(torch.float32, 1, 9, 70)[layout]]
        ref = [m.clone() for m in ms]
        movable = rk.MovableOperand(first, [True, True])
        l1, sq = torch.empty(3, 9), torch.empty(3, 9)
        bitwise = True
        for step in range(3):
            if step == 1:  # new gradients elsewhere, same strides
                now = [_views(torch.float32, 2, 9, 70)[layout], _views(torch.float32, 1, 9, 70)[layout]]
            else:  # back to (and, first, at) the tensors it was built with
                now = first
            for i, (g, g0) in enumerate(zip(now, first)):
                movable.move(i, g.data_ptr() - g0.data_ptr())
            movable.flush()
            rk.accumulate_scores_group(ms, first, l1, sq, grads=movable)
            torch._foreach_add_(ref, now)
            bitwise = bitwise and all(torch.equal(m, r) for m, r in zip(ms, ref))
        out.append({"check": "moved_grads", "case": layout, "bitwise": bitwise})

    # (c) update + error feedback (+ NorMuon epilogue, + ok flag)
    for dtype in (torch.float32, torch.bfloat16):
        for B, R, C, k in [(3, 37, 300, 5), (1, 9, 40, 0), (2, 64, 64, 17)]:
            for layout in ("rowmajor", "transposed", "piece"):
                for mode in ("plain", "valid", "every", "normuon", "skip", "void", "no_decay", "no_decay_skip"):
                    every = mode == "every"
                    kk = R if every else k
                    w = _views(dtype, B, R, C)[layout]
                    mom = _views(torch.float32, B, R, C)[layout]
                    rows = (
                        torch.arange(R).expand(B, R)
                        if every
                        else torch.stack([torch.randperm(R)[:kk].sort().values for _ in range(B)]).reshape(B, kk)
                    )
                    valid = torch.rand(B, kk) > 0.4 if mode == "valid" else None
                    upd = torch.randn(B, kk, C + 3).half()[..., :C]  # a padded result, sliced
                    lr, decay, mu = torch.tensor(0.0173), torch.tensor(0.98), 0.95
                    # without weight decay the kernel leaves unselected rows unread: as decay 1
                    no_decay = mode.startswith("no_decay")
                    if no_decay:
                        decay = torch.tensor(1.0)
                    skip = mode.endswith("skip")
                    den = scale = None
                    applied = upd.float()
                    if mode == "normuon":
                        den, scale = torch.rand(B, kk) + 0.5, torch.rand(B) + 0.5
                        applied = (upd.float() / den[..., None]) * scale[:, None, None]
                    if valid is not None:
                        applied = applied * valid.unsqueeze(-1)  # the reference's NS input was zero there
                    void = None
                    if mode == "void":  # a non-finite result: the reference zeroes it
                        void = torch.arange(B) % 2 == 0
                        upd = torch.where(void[:, None, None], float("nan"), upd)
                        applied = torch.where(void[:, None, None], 0.0, upd.float())
                    w_ref, m_ref = w.clone(), mom.clone()
                    if not skip:
                        _fused_update_reference(w_ref, applied, rows, lr, decay)
                        factor = mu if valid is None else torch.where(valid, mu, 1.0).unsqueeze(-1)
                        idx = rows.unsqueeze(-1).expand(-1, -1, C)
                        m_ref.scatter_(1, idx, m_ref.gather(1, idx).mul_(factor))
                    ok = torch.tensor(not skip)
                    slot = None if every else engine.slots(rows, valid, R)
                    rk.update_rows(
                        w, mom, upd, slot, lr, None if no_decay else decay, mu, den, scale, ok if skip else None, void
                    )
                    out.append(
                        {
                            "check": "update",
                            "case": f"{dtype},{B}x{R}x{C},k={kk},{layout},{mode}",
                            "bitwise": bool(torch.equal(w, w_ref) and torch.equal(mom, m_ref)),
                        }
                    )

    # NorMuon factors against update.normuon_normalize
    for K, C in [(12, 80), (7, 33), (1100, 8)]:  # 1100: more rows than one block of the factors kernel
        o = torch.randn(3, K, C).half()
        v = torch.rand(3, K)
        den, scale, v_new = engine.normuon_factors(engine.row_sumsq(o), v, 0.95, 1e-8, C)
        o_hat, v_ref = normuon_normalize(o, v, 0.95, 1e-8, C)
        got = (o.float() / den[..., None]) * scale[:, None, None]
        out.append({"check": "normuon", "case": f"{K}x{C}", "err": max(rel(got, o_hat), rel(v_new, v_ref))})

    out += _group_checks()
    out += _launch_checks()
    out += _step_checks()
    out += _nonfinite_checks()
    out += _ns_void_checks()
    out += _padded_side_checks()
    return out


# members of one launch: layouts and stack sizes (columns contiguous, rows contiguous, mixed)
GROUPS = [
    (("rowmajor", "piece", "rowmajor"), (1, 3, 2)),
    (("transposed", "transposed"), (2, 1)),
    (("rowmajor", "transposed", "piece"), (1, 2, 1)),
]


def _members(dtype, layouts, batches, R: int, C: int) -> list:
    """One fresh (B_i, R, C) view per member, each in its own allocation."""
    return [_views(dtype, b, R, C)[layout] for layout, b in zip(layouts, batches)]


def _row_state(batches, R: int) -> list:
    """(B_i, R) float32 per-row state views, one strided (a piece of a longer state)."""
    import torch

    return [torch.rand(b, 2 * R)[:, ::2] if i == 0 else torch.rand(b, R) for i, b in enumerate(batches)]


def _group_checks() -> list[dict]:
    """The grouped launches (several members, each its own tensor, strides and stack size)
    against the torch path member by member: accumulate (a member without gradient, the ok
    gate), gather (ragged selection, padding, keep, an inactive member, NorMuon's row state),
    update (valid, every row, NorMuon epilogue and row state, ok = 0, void matrices, an
    inactive member, per-member lr scales)."""
    import torch

    from dion3_titan.kernels import row_engine as rk
    from dion3_titan.kernels.torch_ops import _fused_update_reference
    from dion3_titan.optim import engine
    from dion3_titan.optim.update import l1_scores, take_rows

    out: list[dict] = []
    cache = rk.TableCache()

    def spans(batches):
        ends = torch.tensor(batches).cumsum(0).tolist()
        return [slice(e - b, e) for b, e in zip(batches, ends)]

    # accumulate + score
    R, C = 19, 70
    for dtype in (torch.float32, torch.bfloat16):
        for layouts, batches in GROUPS:
            for ok in (None, True, False):
                ms = _members(dtype, layouts, batches, R, C)
                gs = [None if i == 1 else torch.randn(m.shape).to(dtype) for i, m in enumerate(ms)]
                refs = [m.clone() for m in ms]
                for r, g in zip(refs, gs):
                    if g is not None and ok is not False:
                        torch._foreach_add_([r], [g])
                N = sum(batches)
                l1, sq = torch.full((N, R), float("nan")), torch.full((N, R), float("nan"))
                rk.accumulate_scores_group(ms, gs, l1, sq, None if ok is None else torch.tensor(ok), cache)
                ref = torch.cat(refs)
                out.append(
                    {
                        "check": "group_accumulate",
                        "case": f"{dtype},{layouts},{batches},ok={ok}",
                        "bitwise": all(torch.equal(m, r) for m, r in zip(ms, refs)),
                        "scores_err": max(
                            ((l1 - l1_scores(ref)).abs().max() / l1_scores(ref).abs().max()).item(),
                            ((sq - ref.float().square().sum(-1)).abs().max() / sq.abs().max()).item(),
                        ),
                    }
                )

    # gather + normalize + cast (and NorMuon's row state), into poisoned buffers; with ``mu``
    # the gathered momentum rows decay in place (error feedback), unless ``ok`` is False
    R, C, K, C_out = 23, 70, 9, 72
    mu = 0.95
    for layouts, batches in GROUPS:
        for mode, decay_ok in (
            ("rows", None),
            ("rows+keep", None),
            ("every", None),
            ("rows+keep", "none"),
            ("rows+keep", True),
            ("rows+keep", False),
            ("every", True),
        ):
            N, every = sum(batches), mode == "every"
            n = R if every else K - 2  # ragged: fewer rows than K
            kk = max(K, n)
            ms = _members(torch.float32, layouts, batches, R, C)
            before = [m.clone() for m in ms]
            rows = None if every else torch.stack([torch.randperm(R)[:n].sort().values for _ in range(N)])
            keep = torch.rand(N, n) > 0.3 if mode == "rows+keep" else None
            den = torch.rand(N) + 0.5
            active = [i != 1 for i in range(len(ms))]
            dest = torch.full((N, kk, C_out), float("nan")).half()
            decay = {} if decay_ok is None else {"mu": mu, "ok": None if decay_ok == "none" else torch.tensor(decay_ok)}
            rk.gather_rows_group(ms, rows, dest, keep, den, active, cache, **decay)
            whole = torch.cat(before)
            picked = (
                whole.clone() if every else torch.cat([take_rows(m, rows[s]) for m, s in zip(before, spans(batches))])
            )
            if keep is not None:
                picked = picked * keep.unsqueeze(-1)
            for s, a in zip(spans(batches), active):
                if not a:
                    picked[s] = 0
            want_m = whole.clone()  # the momentum after the launch
            if decay and decay_ok is not False:
                hit = torch.zeros(N, R, dtype=torch.bool)  # rows gathered: selected, kept, active
                if every:
                    hit[:] = True
                else:
                    hit.scatter_(1, rows, torch.ones_like(rows, dtype=torch.bool) if keep is None else keep)
                for s, a in zip(spans(batches), active):
                    hit[s] &= a
                want_m = torch.where(hit.unsqueeze(-1), whole * torch.tensor(mu), whole)
            padded = torch.nn.functional.pad(picked, (0, C_out - C, 0, kk - n))
            ref = torch.div(padded, den[:, None, None], out=torch.empty_like(padded, dtype=torch.float16))
            states = _row_state(batches, R)
            all_rows = torch.arange(R).expand(N, R) if every else rows
            v = engine.gather_row_state(states, all_rows, kk, cache)
            v_ref = torch.nn.functional.pad(torch.cat(states).gather(1, all_rows), (0, kk - n))
            out.append(
                {
                    "check": "group_gather",
                    "case": f"{layouts},{batches},{mode},decay_ok={decay_ok}",
                    "bitwise": bool(torch.equal(dest, ref) and torch.equal(v, v_ref))
                    and torch.equal(torch.cat(ms), want_m),
                }
            )

    # update + error feedback + NorMuon epilogue and row state + gates
    R, C, k = 29, 70, 6
    lr, decay, mu = torch.tensor(0.0173), torch.tensor(0.98), 0.95
    # without weight decay (decay None) the launch walks the selected rows only (``rows``);
    # ``split``: so does it with weight decay, the other rows decayed by a launch of their own
    cases = ((torch.float32, True, False), (torch.bfloat16, True, False), (torch.float32, False, False))
    cases += ((torch.float32, True, True), (torch.bfloat16, True, True))
    for dtype, decays, split in cases:
        decay_arg, decay_ref = (decay, decay) if decays else (None, torch.tensor(1.0))
        for layouts, batches in GROUPS:
            for mode in ("plain", "valid", "every", "normuon", "skip", "void"):
                N, every = sum(batches), mode == "every"
                if split and every:
                    continue  # every row is selected: nothing to split off
                kk = R if every else k
                ws = _members(dtype, layouts, batches, R, C)
                moms = _members(torch.float32, layouts, batches, R, C)
                states = _row_state(batches, R)
                scales = [1.0, 0.37, 2.5][: len(ws)]
                active = [i != 1 for i in range(len(ws))]
                rows = (
                    torch.arange(R).expand(N, R)
                    if every
                    else torch.stack([torch.randperm(R)[:kk].sort().values for _ in range(N)])
                )
                valid = torch.rand(N, kk) > 0.4 if mode == "valid" else None
                upd = torch.randn(N, kk, C + 3).half()[..., :C]  # a padded result, sliced
                den = scale = v_new = None
                applied = upd.float()
                if mode in ("normuon", "valid"):  # NorMuon (with its row state), also masked
                    den, scale, v_new = torch.rand(N, kk) + 0.5, torch.rand(N) + 0.5, torch.rand(N, kk)
                    applied = (upd.float() / den[..., None]) * scale[:, None, None]
                if valid is not None:
                    applied = applied * valid.unsqueeze(-1)
                void = None
                if mode == "void":  # a non-finite result: the reference zeroes it
                    void = torch.arange(N) % 2 == 0
                    upd = torch.where(void[:, None, None], float("nan"), upd)
                    applied = torch.where(void[:, None, None], 0.0, upd.float())
                w_ref, m_ref, v_ref = [w.clone() for w in ws], [m.clone() for m in moms], [v.clone() for v in states]
                for i, s in enumerate(spans(batches)):
                    if mode == "skip" or not active[i]:
                        continue
                    _fused_update_reference(w_ref[i], applied[s], rows[s], lr * scales[i], decay_ref)
                    factor = mu if valid is None else torch.where(valid[s], mu, 1.0).unsqueeze(-1)
                    idx = rows[s].unsqueeze(-1).expand(-1, -1, C)
                    m_ref[i].scatter_(1, idx, m_ref[i].gather(1, idx).mul_(factor))
                    if v_new is not None:
                        old = v_ref[i].gather(1, rows[s])
                        new = v_new[s] if valid is None else torch.where(valid[s], v_new[s], old)
                        v_ref[i].scatter_(1, rows[s], new)
                slot = None if every or not decays else engine.slots(rows, valid, R)
                applied_rows = None if every or (decays and not split) else engine.applied_rows(rows, valid)
                row_state = None if v_new is None else rk.RowState(states, v_new)
                ok = torch.tensor(mode != "skip")
                if split:
                    rk.decay_unselected_group(ws, slot, decay_arg, ok, active, cache)
                    slot = None
                rk.update_rows_group(
                    ws,
                    moms,
                    upd,
                    slot,
                    lr,
                    decay_arg,
                    mu,
                    scales,
                    den,
                    scale,
                    ok,
                    void,
                    row_state,
                    active,
                    cache,
                    rows=applied_rows,
                )
                same = [torch.equal(a, b) for a, b in zip(ws + moms + states, w_ref + m_ref + v_ref)]
                out.append(
                    {
                        "check": "group_update",
                        "case": f"{dtype},{layouts},{batches},k={kk},{mode},decay={decays},split={split}",
                        "bitwise": all(same),
                    }
                )
    return out


def count_launches():
    """A context manager counting Triton kernel launches by kernel name (compiled or
    interpreted, cached or not: every kernel of ours launches through kernels/launch.py)."""
    from dion3_titan.kernels import launch

    return launch.counting()


def _launch_checks() -> list[dict]:
    """The Triton launches of a steady-state step (the second; gradients written in place, as
    under a captured step) do not grow with the number of layers, and that step builds no
    kernel table: Muon at f = 1 and NorMuon (row state) at f = 1/4."""
    import torch

    from dion3_titan import Dion3
    from dion3_titan.optim import engine

    out = []
    runs_on = engine.runs_on
    engine.runs_on = lambda backend, p: True  # NS on torch (fast here); the row engine on
    try:
        for flavor, fraction in (("muon", 1.0), ("normuon", 0.25)):
            launches, builds = {}, {}
            for layers in (1, 3):
                torch.manual_seed(0)
                shapes = [(12, 20), (20, 12), (2, 8, 6)] * layers
                params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
                opt = Dion3([{"params": params}], lr=0.02, fraction=fraction, flavor=flavor, backend="torch")
                for p in params:
                    p.grad = torch.empty_like(p)
                for _ in range(2):
                    for p in params:
                        p.grad.copy_(torch.randn_like(p))
                    before = opt.kernel_tables.builds
                    with count_launches() as counts:
                        opt.step()
                launches[str(layers)], builds[str(layers)] = dict(counts), opt.kernel_tables.builds - before
            out.append(
                {
                    "check": "launches",
                    "case": f"{flavor},f={fraction}",
                    "launches": launches,
                    "steady_builds": builds,
                    "groups": len(opt.shape_groups),
                }
            )
    finally:
        engine.runs_on = runs_on
    return out


def _step_checks() -> list[dict]:
    """Whole Dion3 steps with the engine on against the same steps with it off (same NS):
    muon/normuon, f = 1/4 and 1, a 3D stack, column selection, a parameter without a gradient;
    one case without weight decay (the engine then leaves unselected rows unread) and one
    without momentum. The momentum must come out bit for bit the reference's, and the pack
    must leave the error feedback to the accumulate exactly where every row is selected and
    mu > 0."""
    import itertools

    import torch

    from dion3_titan import Dion3
    from dion3_titan.optim import engine

    out = []
    cases = [(*c, 0.1, 0.95) for c in itertools.product(("muon", "normuon"), (0.25, 1.0), ("rows", "cols"))]
    cases += [("normuon", 0.25, "rows", 0.0, 0.95), ("muon", 1.0, "rows", 0.1, 0.0)]
    for flavor, fraction, selection_dim, weight_decay, momentum in cases:
        finals, used, pack_mus = [], [], set()
        for fused in (True, False):
            torch.manual_seed(5)
            params = [
                torch.nn.Parameter(torch.randn(48, 80) * 0.02),
                torch.nn.Parameter(torch.randn(2, 40, 24) * 0.02),
                torch.nn.Parameter(torch.randn(48, 80) * 0.02),
            ]
            # NS on torch in both runs (the interpreter's GEMMs are slow); the engine on or off
            start = [p.detach().clone() for p in params]
            opt = Dion3(
                [{"params": params}],
                lr=0.02,
                fraction=fraction,
                flavor=flavor,
                weight_decay=weight_decay,
                momentum=momentum,
                backend="torch",
                selection_dim=selection_dim,
            )
            runs_on, update, pack = engine.runs_on, engine.update, engine.pack
            engine.runs_on = lambda backend, p, on=fused: on
            calls = []
            engine.update = lambda *a, **kw: (calls.append(1), update(*a, **kw))
            engine.pack = lambda *a, **kw: (pack_mus.add(kw["mu"]), pack(*a, **kw))[1]
            try:
                for step in range(3):
                    for j, p in enumerate(params):
                        p.grad = None if (j == 2 and step == 1) else torch.randn_like(p)
                    opt.step()
            finally:
                engine.runs_on, engine.update, engine.pack = runs_on, update, pack
            used.append(bool(calls) == fused)
            # what the steps changed (the weights themselves would hide a wrong update)
            finals.append(
                [p.detach() - p0 for p, p0 in zip(params, start)] + [opt.state[p]["momentum"].clone() for p in params]
            )
        moms = len(params)  # the momenta, compared bit for bit (with mu = 0 they are zero)
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(finals[0][:-moms], finals[1][:-moms]))
        out.append(
            {
                "check": "step",
                "case": f"{flavor},f={fraction},{selection_dim},wd={weight_decay},mu={momentum}",
                "err": err,
                "engine_used": all(used),
                "momentum_bitwise": all(torch.equal(a, b) for a, b in zip(finals[0][-moms:], finals[1][-moms:])),
                # the mu each pack applied (None: the accumulate had applied it)
                "pack_mu": sorted(pack_mus, key=str),
                "feedback_in_accumulate": fraction == 1.0 and momentum > 0,
                "momentum": momentum,
            }
        )
    return out


def _padded_side_checks() -> list[dict]:
    """Steps whose backend runs at a padded Gram side, reading the products over it only to its
    depth (as CuteDSL does at 2752 rows of 2816): the engine's pack writes each wide batch at
    that side, orthogonalize is told the batch's real rows, and the steps move the weights as
    the same steps on the plain torch backend do (NS in float32: to rounding)."""
    import itertools

    import torch

    import dion3_titan.optim.dion3 as dion3_module
    from dion3_titan import Dion3
    from dion3_titan.kernels.torch_ops import TorchOps
    from dion3_titan.optim import engine, stages_engine
    from tests.test_orthogonalize import PaddedSideOps

    out = []
    saved = engine.runs_on, dion3_module.select_backend, stages_engine.select_backend, dion3_module.orthogonalize
    engine.runs_on = lambda backend, p: True
    try:
        for flavor, fraction in itertools.product(("muon", "normuon"), (0.25, 1.0)):
            moved, calls = [], []
            for backend in (TorchOps(), PaddedSideOps(32, depth=8)):
                dion3_module.select_backend = stages_engine.select_backend = lambda *args, b=backend: b

                def spy(x, *args, **kwargs):
                    calls.append((x.shape[1], kwargs.get("rows", args[5] if len(args) > 5 else None)))
                    return saved[3](x, *args, **kwargs)

                dion3_module.orthogonalize = spy
                torch.manual_seed(5)
                params = [torch.nn.Parameter(torch.randn(48, 80) * 0.02), torch.nn.Parameter(torch.randn(2, 40, 24))]
                start = [p.detach().clone() for p in params]
                opt = Dion3([{"params": params}], lr=0.02, fraction=fraction, flavor=flavor, ns_dtype="float32")
                for _ in range(2):
                    for p in params:
                        p.grad = torch.randn_like(p)
                    opt.step()
                moved.append([p.detach() - p0 for p, p0 in zip(params, start)])
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(*moved))
            out.append(
                {
                    "check": "padded_side",
                    "case": f"{flavor},f={fraction}",
                    "err": err,
                    "calls": calls,
                    "inner": sorted(set(backend.inner)),
                }
            )
    finally:
        engine.runs_on, dion3_module.select_backend, stages_engine.select_backend, dion3_module.orthogonalize = saved
    return out


def _nonfinite_checks() -> list[dict]:
    """The engine's gates: a step with a non-finite gradient (nonfinite="skip") leaves every
    parameter, state tensor and counter bit for bit as it was, eager and as the captured body."""
    import torch

    from dion3_titan import Dion3
    from dion3_titan.optim import engine
    from tests.test_nonfinite import BAD_STEP, NAMES, _build, _set_grads, _snapshot

    out = []
    runs_on, update = engine.runs_on, engine.update
    calls = []
    engine.runs_on = lambda backend, p: True
    engine.update = lambda *a, **kw: (calls.append(1), update(*a, **kw))
    try:
        # both flavors, both fractions and both paths, in four runs
        for flavor, fraction, captured in [
            ("muon", 0.25, False),
            ("normuon", 0.25, True),
            ("normuon", 1.0, False),
            ("muon", 1.0, True),
        ]:
            opt = _build(Dion3, "skip", flavor=flavor, fraction=fraction, backend="torch")
            for step in range(BAD_STEP):
                _set_grads(opt, step)
                opt.step()
            before = _snapshot(opt)
            _set_grads(opt, BAD_STEP, poison=NAMES[0])
            if captured:
                opt.load_hyperparameters()
                opt.step_body()
            else:
                opt.step()
            after = _snapshot(opt)
            same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
            out.append(
                {
                    "check": "nonfinite",
                    "case": f"{flavor},f={fraction},captured={captured}",
                    "ok": same,
                    "engine_used": bool(calls),
                }
            )
    finally:
        engine.runs_on, engine.update = runs_on, update
    return out


def _ns_void_checks() -> list[dict]:
    """A Newton-Schulz result that is not finite, under the engine. The check comes from NS's
    last product where the backend flags it there (``Backend.mm_checked``), else from the rows'
    sums of squares (which NorMuon's epilogue reads anyway); either way exactly that matrix
    only decays, every other one moves as in a clean run, and it is counted. ``sums``: the
    groups whose result's rows were summed."""
    import itertools

    import torch

    import dion3_titan.optim.dion3 as dion3_module
    from dion3_titan import Dion3
    from dion3_titan.optim import engine
    from tests.test_dion3_core import NAMES, make_params, oriented
    from tests.test_nonfinite import CORRUPTED, WIDE_SIDE, CorruptOneGram, FlaggingCorruptOneGram, _build, _run

    out = []
    runs_on, select, row_sumsq = engine.runs_on, dion3_module.select_backend, engine.row_sumsq
    engine.runs_on = lambda backend, p: True
    summed = []
    engine.row_sumsq = lambda x: summed.append(x.shape) or row_sumsq(x)
    try:
        cases = [
            (*case, True) for case in itertools.product(("normuon", "muon"), (CorruptOneGram, FlaggingCorruptOneGram))
        ]
        for flavor, corrupt_backend, checked in [*cases, ("muon", FlaggingCorruptOneGram, False)]:
            dion3_module.CHECKED_PRODUCT = checked  # the A/B switch: False reads the result
            opts = []
            for backend in (None, corrupt_backend(WIDE_SIDE, CORRUPTED, 1)):
                summed.clear()
                dion3_module.select_backend = select if backend is None else (lambda *args, b=backend: b)
                opt = _build(Dion3, "raise", fraction=1.0, ns_algorithm="gram", flavor=flavor)
                _run(opt, 1, "eager", bad_step=-1)
                opts.append(opt)
            clean, corrupt = opts
            start = dict(zip(NAMES, make_params(7)))
            decay = 1 - 0.02 * 0.1  # lr' wd at f = 1
            moved, unexplained = [], []
            for name, p, q in zip(NAMES, corrupt.param_groups[0]["params"], clean.param_groups[0]["params"]):
                for i, (a, b, a0) in enumerate(zip(oriented(p.detach()), oriented(q.detach()), oriented(start[name]))):
                    if torch.equal(a, b):
                        continue
                    moved.append(f"{name}[{i}]")
                    if not torch.allclose(a, a0.detach() * decay, rtol=1e-6, atol=0):
                        unexplained.append(f"{name}[{i}]")
            out.append(
                {
                    "check": "ns_void",
                    "case": f"{flavor},{corrupt_backend.__name__}{'' if checked else ',unchecked'}",
                    "events": corrupt.nonfinite_ns_events,
                    "moved": moved,
                    "unexplained": unexplained,
                    "sums": len(summed),
                    "flagged": getattr(backend, "checked", 0),  # the corrupting backend's
                }
            )
    finally:
        engine.runs_on, dion3_module.select_backend, engine.row_sumsq = runs_on, select, row_sumsq
        dion3_module.CHECKED_PRODUCT = True
    return out


def _cpu_graphs(runner_of):
    """Stand-ins for the CUDA calls of optim/cuda_graph.py, so that ``GraphedOptimizer`` runs on
    CPU with its own capture and refresh code. Inside the stand-in capture the row engine
    behaves as in a real one (``row_engine.operands._capturing``): a missing kernel table raises and no
    table is written. Its body runs: that is the capture and the first replay in one
    (``GraphedOptimizer.step`` replays right after capturing, with nothing changed between). A
    later replay runs the captured body again reading what the graph would read: every
    gradient at the tensor it was captured at (``captured_gradients``), except through the
    accumulate pass's movable tables (the operands the capture made, as last flushed).
    ``runner_of()``: the GraphedOptimizer being captured. Returns the undo."""
    import contextlib

    import torch

    from dion3_titan.kernels import row_engine as rk
    from dion3_titan.optim.cuda_graph import GraphedOptimizer
    from dion3_titan.optim.moving_grads import MovingGradients

    make = MovingGradients.operand

    class Graph:
        def __init__(self) -> None:
            self.runner, self.replays = runner_of(), 0

        def replay(self) -> None:
            self.replays += 1
            if self.replays == 1:
                return  # the capture ran it
            runner, moving = self.runner, self.runner.moving_gradients
            made = iter(moving.operands)
            captured = runner.captured_gradients
            now = [p.grad for p, _ in captured]
            for p, held in captured:
                p.grad = held
            moving.operand = lambda members, views, present: next(made)
            try:
                runner.optimizer.step_body(moving)
            finally:
                del moving.operand
                for (p, _), g in zip(captured, now):
                    p.grad = g
            assert next(made, None) is None, "the replay launched fewer accumulate passes than captured"

    def operand(self, *args):
        # a real capture launches nothing, so the table may be written after it (flush); this
        # one runs the launch: it gets the table's first rows where it is made
        op = make(self, *args)
        op.table.copy_(op.host_table())
        return op

    @contextlib.contextmanager
    def graph(g, stream=None):
        capturing = rk.operands._capturing
        rk.operands._capturing = lambda device: True
        MovingGradients.operand = operand
        try:
            yield
        finally:
            rk.operands._capturing = capturing
            MovingGradients.operand = make

    saved = [
        (torch.cuda, name, getattr(torch.cuda, name)) for name in ("CUDAGraph", "graph", "synchronize", "Stream")
    ] + [(GraphedOptimizer, "_side_stream_run", GraphedOptimizer._side_stream_run)]
    torch.cuda.CUDAGraph, torch.cuda.graph = Graph, graph
    torch.cuda.synchronize = torch.cuda.Stream = lambda *a, **kw: None
    GraphedOptimizer._side_stream_run = lambda self, fn: fn()

    def undo() -> None:
        for owner, name, value in saved:
            setattr(owner, name, value)

    return undo


def _replay_checks() -> list[dict]:
    """GraphedOptimizer's capture and replays (emulated on CPU, ``_cpu_graphs``) against eager
    steps, bit for bit, when every step's gradients are new tensors (set to None) at new
    addresses, the capture step's too: their distance within a shape group changes every step,
    so no eager step built a cached table for the captured gradients. Without a given norm
    every gradient is copied into its captured tensor and the tables stay where it was
    captured (a NaN on a replay is then seen by the step's own finiteness pass, which reads
    the captured tensors: the step is skipped as eagerly); with a norm the matrices'
    gradients are read where they are and only AdamW's is copied."""
    import torch

    from dion3_titan.optim import engine
    from tests.optimizers import normuon_quarter

    shapes = [(24, 40), (24, 40), (2, 16, 24), (40, 24), (40,)]  # the last: AdamW
    steps, warmup, nan_step = 6, 1, 4  # captured at step 1, replayed from 2; a NaN on replay 4
    runner = None
    undo = _cpu_graphs(lambda: runner)
    runs_on = engine.runs_on
    engine.runs_on = lambda backend, p: True  # NS on torch (fast here); the row engine on
    buffers = []  # every step's gradients stay allocated: no address comes back
    out = []
    try:
        for norm_given in (False, True):
            finals, copied, kept, covered, error = [], [], None, None, None
            for graphed in (False, True):
                torch.manual_seed(3)
                params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
                opt, runner = normuon_quarter(params, graphed, warmup, backend="torch", nonfinite="skip")
                tables = None
                try:
                    for step in range(steps):
                        runner.zero_grad(set_to_none=True)
                        g = torch.Generator().manual_seed(100 + step)
                        values = [torch.randn(s, generator=g) for s in shapes]
                        if step == nan_step:
                            values[0].view(-1)[7] = float("nan")
                        gap = 4 * (step + 1)  # floats between gradients: 16-byte multiples, new each step
                        buf = torch.empty(sum(v.numel() + gap for v in values))
                        buffers.append(buf)
                        at = 0
                        for prm, v in zip(params, values):
                            at += gap
                            prm.grad = buf[at : at + v.numel()].view_as(v).copy_(v)
                            at += v.numel()
                        if norm_given:
                            runner.use_gradient_norm(torch.nn.utils.get_total_norm([prm.grad for prm in params]))
                        runner.step()
                        if graphed and runner.graph is not None:
                            copied.append(runner.copied_grads)
                            if tables is None:
                                tables = [op.table.clone() for op in runner.moving_gradients.operands]
                                covered = all(runner.moving_gradients.covers(prm) for prm in params[:-1])
                    if graphed:
                        ops = runner.moving_gradients.operands
                        kept = all(torch.equal(a, op.table) for a, op in zip(tables, ops))
                        runner.release()
                except Exception as exc:  # noqa: BLE001  (reported as the check's failure)
                    error = f"{type(exc).__name__}: {exc}"
                    break
                state = [t for prm in params for t in opt.state[prm].values() if torch.is_tensor(t)]
                finals.append(
                    ([t.detach().clone().reshape(-1).view(torch.uint8) for t in params + state], opt.skipped_steps)
                )
            out.append(
                {
                    "check": "replay",
                    "case": "norm" if norm_given else "own_pass",
                    "error": error,
                    "bitwise": error is None and all(torch.equal(a, b) for a, b in zip(finals[0][0], finals[1][0])),
                    "skipped": [f[1] for f in finals],
                    "copied": copied,
                    "matrices_covered": covered,
                    "tables_kept": kept,
                    "params": len(shapes),
                    "replays": steps - warmup,
                }
            )
    finally:
        engine.runs_on = runs_on
        undo()
    return out


# ---------------------------------------------------------------- pytest side (parent process)
@pytest.fixture(scope="module")
def results(module_seed: int) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, __file__, str(module_seed)], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _of(results: list[dict], check: str) -> list[dict]:
    found = [r for r in results if r["check"] == check]
    assert found, f"no {check} results"
    return found


def test_accumulate_adds_bitwise_and_scores_rows(results) -> None:
    bad = [r for r in _of(results, "accumulate") if not (r["bitwise"] and r["l1_err"] < 1e-5 and r["sq_err"] < 1e-5)]
    assert not bad, bad


def test_gather_matches_take_rows_pad_divide_cast_bitwise(results) -> None:
    bad = [r for r in _of(results, "gather") if not (r["bitwise"] and r["finite"])]
    assert not bad, bad


def test_pack_normalizes_by_the_selected_rows_norm(results) -> None:
    bad = [r for r in _of(results, "pack_norm") if not r["err"] < 1e-3]  # one fp16 rounding
    assert not bad, bad


def test_update_matches_reference_bitwise(results) -> None:
    bad = [r["case"] for r in _of(results, "update") if not r["bitwise"]]
    assert not bad, bad


def test_normuon_factors_match_normuon_normalize(results) -> None:
    bad = [r for r in _of(results, "normuon") if not r["err"] < 1e-5]
    assert not bad, bad


def test_step_with_engine_matches_reference_path(results) -> None:
    # the engine differs only in summation order of norms (fp16 NS input rounding); the
    # momentum not at all
    bad = [r for r in _of(results, "step") if not (r["err"] < 1e-2 and r["engine_used"] and r["momentum_bitwise"])]
    assert not bad, bad


def test_error_feedback_of_every_row_runs_in_the_accumulate(results) -> None:
    # at f = 1 (mu > 0) no pack writes the momentum back; otherwise each applies mu itself
    for r in _of(results, "step"):
        expected = [None] if r["feedback_in_accumulate"] else [r["momentum"]]
        assert r["pack_mu"] == expected, r


def test_grouped_launches_match_the_torch_path_bitwise(results) -> None:
    for check in ("group_accumulate", "group_gather", "group_update"):
        bad = [r for r in _of(results, check) if not r["bitwise"] or r.get("scores_err", 0.0) > 1e-5]
        assert not bad, bad  # each result carries the seed of its inputs


def test_step_launches_do_not_grow_with_layers(results) -> None:
    for r in _of(results, "launches"):
        one, three = r["launches"]["1"], r["launches"]["3"]  # (JSON keys)
        assert one == three, r  # whatever the number of layers
        assert one["_update_rows_kernel"] == r["groups"], r  # one launch per shape group
        assert set(r["steady_builds"].values()) == {0}, r  # a steady step builds no table


def test_table_cache_builds_each_table_once() -> None:
    """Operand tables: offsets from the first view in elements, per matrix of each stack; one
    build per key (a single tensor's key is its shape and strides, not its address); the least
    recently used entry goes beyond the capacity."""
    import torch

    from dion3_titan.kernels.row_engine import COLS_UNIT, TableCache, operand

    cache = TableCache(capacity=2)
    a, b = torch.zeros(2, 3, 4), torch.zeros(1, 3, 8)[..., :4]
    op = operand([a, b], [True, True], cache)
    delta = (b.data_ptr() - a.data_ptr()) // 4
    assert op.base is a and op.layout == COLS_UNIT
    assert op.table.tolist() == [[0, 4, 1, 1], [12, 4, 1, 1], [delta, 8, 1, 1]]
    assert operand([a, b], [True, False], cache).table.tolist()[2] == [0, 0, 0, 0]  # absent: never read
    assert operand([a, b], [True, True], cache).table is op.table and cache.builds == 2
    operand([torch.ones(2, 3, 4)], cache=cache)
    operand([torch.ones(2, 3, 4)], cache=cache)  # another tensor of the same shape: same table
    assert cache.builds == 3
    operand([a, b], [True, False], cache)  # the least recently used key: evicted, built again
    assert cache.builds == 4


def test_kept_views_make_their_operand_key_once() -> None:
    """Views the optimizer keeps between steps (``KeptViews``) give the operand a list of the
    same views gives, per presence pattern, and keep its key (and their (B, R, 1) column form)
    with them; views not kept get both afresh."""
    import torch

    from dion3_titan.kernels.row_engine import KeptViews, TableCache, column_views, operand

    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 6, 10, generator=g)
    views = [base[:2, ::2], base[2:, 1::2], torch.randn(1, 3, 10, generator=g)]
    kept = KeptViews(views)
    for present in ([True, True, True], [False, True, True], None):
        cache = TableCache()
        listed, held = operand(views, present, cache), operand(kept, present, cache)
        assert held.table is listed.table and cache.builds == 1, present  # one key, one table
        assert (held.layout, held.align, held.base) == (listed.layout, listed.align, listed.base)
    assert len(kept.keys) == 2  # one key per presence pattern (None: all present), kept
    states = KeptViews(torch.randn(2, 5, generator=g) for _ in range(2))
    assert column_views(states) is column_views(states)
    assert [tuple(v.shape) for v in column_views(states)] == [(2, 5, 1), (2, 5, 1)]
    assert all(v.data_ptr() == s.data_ptr() for v, s in zip(column_views(states), states))
    assert column_views(list(states)) is not column_views(list(states))


def test_captured_accumulate_reads_moved_gradients(results) -> None:
    bad = [r for r in _of(results, "moved_grads") if not r["bitwise"]]
    assert not bad, bad


def test_moving_gradients_moves_every_reader_or_none() -> None:
    """A parameter read by two launches moves in both; a distance that breaks one table's
    alignment moves neither (the caller copies instead); absent views are never registered."""
    from types import SimpleNamespace

    import torch

    from dion3_titan.optim.moving_grads import MovingGradients

    p, q = torch.nn.Parameter(torch.zeros(2, 8)), torch.nn.Parameter(torch.zeros(2, 8))
    member, other = SimpleNamespace(param=p), SimpleNamespace(param=q)  # all a binding reads of a Member
    g = torch.zeros(1, 2, 8)
    moving = MovingGradients(3, g.device)
    a = moving.operand([member, other], [g, g], [True, False])
    b = moving.operand([member], [g], [True])
    with pytest.raises(RuntimeError, match="more than the 3 matrices"):
        moving.operand([member], [g], [True])
    assert moving.covers(p) and not moving.covers(q)
    assert a.align == b.align == 4  # float32 views, offsets multiples of 16 bytes
    assert not moving.move(p, 4)  # one float: breaks the alignment, nothing moved
    moving.flush()
    assert a.table.tolist()[0][0] == b.table.tolist()[0][0] == 0
    assert moving.move(p, 64)
    moving.flush()
    assert a.table.tolist()[0][0] == b.table.tolist()[0][0] == 16
    assert a.table.tolist()[1] == [0, 0, 0, 0]


def test_captured_step_reads_new_gradient_tensors_with_and_without_a_norm(results) -> None:
    """``_replay_checks``: captured with every step's gradients at new addresses, the replayed
    steps equal the eager ones bit for bit (a NaN replay skipped as eagerly). The accumulate
    pass reads the matrices' gradients through movable tables in both: without a norm every
    gradient is copied and the tables stay put, with one only AdamW's is copied."""
    by_case = {r["case"]: r for r in _of(results, "replay")}
    for r in by_case.values():
        assert r["error"] is None and r["bitwise"], r
        assert r["skipped"] == [1, 1] and r["matrices_covered"], r
    own, norm = by_case["own_pass"], by_case["norm"]
    # the capture step (its own gradients: nothing to copy), then every replay
    assert own["copied"] == [0] + [own["params"]] * (own["replays"] - 1), own
    assert own["tables_kept"], own
    assert norm["copied"] == [0] + [1] * (norm["replays"] - 1), norm
    assert not norm["tables_kept"], norm  # moved to the new gradients


def test_engine_skips_a_nonfinite_step_bit_for_bit(results) -> None:
    bad = [r for r in _of(results, "nonfinite") if not (r["ok"] and r["engine_used"])]
    assert not bad, bad


def test_engine_packs_at_a_padded_gram_side_and_names_the_rows(results) -> None:
    # (batch rows, rows named) of each orthogonalize call, plain backend (nothing padded, no
    # rows named) then padded, and the padded backend's products' inner dimensions: 48 x 80
    # selects 12 rows at f = 1/4 (side 32, read to 16), 2 x 40 x 24 selects 10 (side 32, read
    # to 16); at f = 1 48 x 80 runs at side 64 read to 48, and 40 x 24 is tall (no rows named:
    # transposed and padded inside, 24 -> 32 read to 24); X X^T reads the columns (80, 24, 40)
    expected = {
        0.25: ({(12, None), (10, None)}, {(32, 12), (32, 10)}, [16, 24, 80]),
        1.0: ({(48, None), (40, None)}, {(64, 48), (40, None)}, [24, 40, 48, 80]),
    }
    found = {r["case"]: r for r in _of(results, "padded_side")}
    assert set(found) == {f"{f},f={fr}" for f in ("muon", "normuon") for fr in expected}
    for r in found.values():
        plain, padded, inner = expected[float(r["case"].split("=")[1])]
        calls = [tuple(c) for c in r["calls"]]
        assert r["err"] < 1e-4, r
        assert set(calls[: len(calls) // 2]) == plain and set(calls[len(calls) // 2 :]) == padded, r
        assert r["inner"] == inner, r


def test_engine_drops_a_nonfinite_ns_result(results) -> None:
    found = {r["case"]: r for r in _of(results, "ns_void")}
    cases = {f"{f},{b}" for f in ("normuon", "muon") for b in ("CorruptOneGram", "FlaggingCorruptOneGram")}
    assert set(found) == cases | {"muon,FlaggingCorruptOneGram,unchecked"}
    bad = [r for r in found.values() if not (r["events"] == 1 and len(r["moved"]) == 1 and not r["unexplained"])]
    assert not bad, bad
    # the flagged product replaces the Muon flavor's pass over the result; NorMuon sums its
    # rows for its epilogue either way
    assert found["muon,FlaggingCorruptOneGram"]["sums"] == 0, found
    assert all(found[f"{f},FlaggingCorruptOneGram"]["flagged"] > 0 for f in ("normuon", "muon")), found
    assert found["muon,CorruptOneGram"]["sums"] > 0 and found["normuon,FlaggingCorruptOneGram"]["sums"] > 0, found
    unchecked = found["muon,FlaggingCorruptOneGram,unchecked"]  # dion3.CHECKED_PRODUCT = False
    assert unchecked["sums"] > 0 and unchecked["flagged"] == 0, found


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the pytest tests do)")
    from tests.interpret import patch_language_once

    patch_language_once()
    seed = int(sys.argv[1])
    for result in _run_checks(seed) + _replay_checks():  # the emulated capture: on CPU only
        print(json.dumps({**result, "seed": seed}))


# ---------------------------------------------------------------- FSDP2 ranks (gloo, interpreter)
def _fsdp_worker(rank, world, configs, out_path):
    import torch

    from dion3_titan.optim import engine
    from tests.interpret import patch_language_once
    from tests.test_dist_fsdp import _run

    patch_language_once()
    assert engine.runs_on("triton", torch.zeros(1)), "the ranks must run the engine (TRITON_INTERPRET=1)"
    results = [_run(world, *c) for c in configs]
    if rank == 0:
        torch.save(results, out_path)


def test_engine_under_fsdp_matches_the_textbook_update(tmp_path, monkeypatch) -> None:
    """Two gloo ranks with FSDP2 (sharded rows move through the exchange; uneven shards, empty
    ranks, a 3D stack), the engine on: the same textbook references as tests/test_dist_fsdp.py."""
    import torch

    from tests.spawn import spawn
    from tests.test_dist_fsdp import CONFIGS, SHAPES

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import Triton with it
    out = tmp_path / "r.pt"
    spawn(2, _fsdp_worker, [(*c, 1, 3, SHAPES, "cpu", "triton") for c in CONFIGS], str(out))
    for config, r in zip(CONFIGS, torch.load(out)):
        for name, got, want in zip(SHAPES, r["final"], r["ref"]):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (config, name, (got - want).abs().max())
