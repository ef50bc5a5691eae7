"""A/B timing of the Triton symmetric GEMM against another revision of it and across tile
configs, and of the persistent TMA GEMM (kernels/triton_mm.py) against cuBLAS, in one run.

    git show REV:dion3_titan/kernels/triton_ops.py > /tmp/base_triton_ops.py
    mkdir -p base && for f in cute_symm cute_symm_sm90; do git show REV:dion3_titan/kernels/$f.py > base/$f.py; done
    python scripts/bench_sym_ab.py [--baseline /tmp/base_triton_ops.py] [--cute-baseline base/cute_symm.py] \
        [--shapes 4x8192,16x2816x4096] [--gemm 32x2048x2048x2048+c,16x2816x2816x4096] [--reps 5]

``--shapes``: L x n (k = n) or L x n x k, fp16: cuBLAS bmm, our CuteDSL kernel (its defaults and
each ``--cute-variants`` setting, e.g. STAGES=5; with ``--cute-baseline`` another revision's
too), on X X^T and on X Y^T with Y another copy of X (the product whose diagonal blocks are
mirrored: "cute_mirror"), and quack's ``gemm_symmetric`` where importable, then the persistent TMA
kernel (in each of ``SYM_TMA_CONFIGS``, or with ``--configs default`` in the two configs
``sym_gemm`` chooses from), the per-tile kernel and the TMA kernel with C (alpha*AB + beta*C,
square shapes only, each of ``SYM_TMA_C_CONFIGS``), baseline (when given) and current. All
kernels of a shape are timed ``reps`` times with ``triton.testing.do_bench``, interleaved (every
kernel once, then again in reverse order, ...: a card's rate drifts over a call); the median of
those runs is reported, with which kernel
``sym_gemm`` dispatches to. Every result is checked for exact symmetry and a lower triangle
equal to the current default's first (a config that does not build is reported as such). ``--gemm``: L x M x K x N, "+c" for alpha*AB + beta*C (C is B itself when
square, as in X <- aX + BX): cuBLAS bmm/baddbmm against ``mm_tma`` in each of ``GEMM_CONFIGS``
(a config that does not build or fit is reported as such), our CuteDSL kernel's general mode
(its defaults, each ``--cute-variants`` setting, with the finiteness check, and the
``--cute-baseline`` revision's with and without it) and quack's GEMM, each result checked
against cuBLAS.
Rates count the FLOPs each kernel runs (2LMKN; the symmetric kernel its lower tiles only). With
$OUT set the rows are also written to $OUT/bench_sym_ab.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from benchmarks.output import output_path, write_json
from benchmarks.revision import load_revision
from benchmarks.timing import do_bench_ms
from dion3_titan.kernels import triton_mm
from dion3_titan.kernels import triton_ops as current

GEMM_CONFIGS = [  # triton_mm.Config fields: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP, warps, stages, split, ws)
    (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4, True),
    (128, 256, 64, 8, 8, 3, True),
    (128, 256, 64, 8, 8, 3, False, True),
    (128, 256, 64, 8, 8, 3, True, True),
    (128, 128, 64, 8, 8, 4, False, True),
]
SYM_TMA_CONFIGS = [  # triton_ops.TmaConfig fields: (BLOCK, BLOCK_K, GROUP, num_warps, num_stages[, ws, wide])
    (128, 64, 8, 8, 4),
    (128, 64, 8, 8, 3),
    (128, 64, 8, 4, 4),
    (128, 64, 8, 8, 4, True),
    (128, 64, 8, 8, 3, False, True),
    (128, 64, 8, 8, 4, False, True),
    (128, 64, 16, 8, 3, False, True),
    (128, 64, 8, 8, 3, True, True),
]
SYM_TMA_C_CONFIGS = [(128, 64, 8, 8, 4), (128, 64, 8, 8, 3, False, True), (128, 64, 8, 8, 4, False, True)]


def _interleaved(fns: list, reps: int) -> list[list[float]]:
    """Each of ``fns`` timed ``reps`` times, in alternating order (A B C, C B A, ...)."""
    runs: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            runs[i].append(do_bench_ms(fns[i], rep=200, return_mode="mean"))
    return runs


def _sym_checked(fn, want: torch.Tensor, label: str) -> bool:
    """Whether ``fn()`` builds and runs; prints whether its result is exactly symmetric and how
    far its lower triangle is from ``want``'s (another tile config may round differently)."""
    try:
        y = fn()
    except Exception as exc:  # e.g. more shared memory than the SM has
        print(f"{label}: {type(exc).__name__}: {str(exc)[:160]}")
        return False
    if y is None:
        print(f"{label}: does not fit")
        return False
    diff = ((y.float() - want.float()).norm() / want.float().norm()).item()
    print(f"{label}: symmetric {torch.equal(y, y.mT)}, rel. difference to the default {diff:.1e}")
    return True


def _with_cute(setting: str, fn):
    """``fn`` run with CuteDSL kernel settings switched, e.g. "STAGES=5" or "PAIR_MIN_N=256+GROUP=4"."""
    from dion3_titan.kernels import cute_symm

    changes = {name: int(value) for name, value in (part.split("=") for part in setting.split("+"))}

    def run():
        saved = {name: getattr(cute_symm, name) for name in changes}
        for name, value in changes.items():
            setattr(cute_symm, name, value)
        try:
            return fn()
        finally:
            for name, value in saved.items():
                setattr(cute_symm, name, value)

    return run


def _cute_cases(module, rev: str, x, y, c, square: bool, variants: list[str]) -> list:
    """(label, revision, fn) of one cute_symm module: X X^T, X Y^T (mirrored), with C where
    ``square``, each also under ``variants`` (current revision only)."""
    products = [("cute", lambda: module.sym_gemm(x, x.mT)), ("cute_mirror", lambda: module.sym_gemm(x, y.mT))]
    if square:
        products += [
            ("cute_addmm", lambda: module.sym_gemm(x, x.mT, c, 0.5, -1.5)),
            ("cute_mirror_addmm", lambda: module.sym_gemm(x, y.mT, c, 0.5, -1.5)),
        ]
    cases = [(label, rev, lambda m, fn=fn: fn()) for label, fn in products]
    for v in variants if rev == "current" else ():
        cases += [(f"{label}({v})", rev, lambda m, fn=fn, v=v: _with_cute(v, fn)()) for label, fn in products]
    return cases


def cute_and_quack(x, c, want, want_c, shape: str, cute_variants: list[str], cute_base=None) -> list:
    """Our CuteDSL kernel (its defaults, each of ``cute_variants``, and ``cute_base``'s when
    given) and quack's symmetric GEMM, for X X^T and X Y^T (Y a copy of X: the same values, the
    diagonal mirrored), with C where ``want_c`` is given, where importable; each result checked
    against the Triton kernel's (quack rounds in its own order: its difference is printed, not
    required to be 0). Returns (label, revision, fn)."""
    found = []
    y = x.clone()
    try:
        from dion3_titan.kernels import cute_symm

        if cute_symm.is_available():
            found += _cute_cases(cute_symm, "current", x, y, c, want_c is not None, cute_variants)
            if cute_base is not None:
                found += _cute_cases(cute_base, "baseline", x, y, c, want_c is not None, [])
    except ImportError as exc:
        print(f"cute unavailable: {exc}")
    try:
        from quack.gemm_interface import gemm_symmetric

        found.append(("quack", None, lambda m: gemm_symmetric(x, x.mT)))
        if want_c is not None:
            found.append(("quack_addmm", None, lambda m: gemm_symmetric(x, x.mT, C=c, alpha=0.5, beta=-1.5)))
    except ImportError as exc:
        print(f"quack unavailable: {exc}")
    ok = []
    for label, rev, fn in found:
        ref = want_c if "addmm" in label else want  # "cute_addmm(STAGES=3)" too
        if _sym_checked(lambda: fn(None), ref, f"{shape} {label} {rev or ''}"):
            ok.append((label, rev, fn))
    return ok


def sym_rows(
    base, shapes: list[str], reps: int, only_default: bool = False, cute_variants: list[str] = (), cute_base=None
) -> list[dict]:
    rows = []
    revisions = [("baseline", base), ("current", current)] if base is not None else [("current", current)]
    for shape in shapes:
        L, n, *rest = (int(v) for v in shape.split("x"))
        k = rest[0] if rest else n
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(L, n, k, device="cuda", dtype=torch.float16, generator=gen) / k**0.5
        c = torch.randn(L, n, n, device="cuda", dtype=torch.float16, generator=gen)
        c = (c + c.mT) / 2
        want = current.sym_gemm_tma(x, x.mT)
        want_c = current.sym_gemm_tma(x, x.mT, c, 0.5, -1.5) if k == n else None
        picks = (
            "tma" if current.tma_pays(L, n, k, torch.cuda.get_device_properties(0).multi_processor_count) else "tile"
        )
        print(f"L={L} n={n} k={k}: sym_gemm dispatches to {picks}")
        kernels = [("tile", lambda m, cfg=None: m.sym_gemm(x, x.mT, config=m.SYM_CONFIG))]
        configs, c_configs = SYM_TMA_CONFIGS, SYM_TMA_C_CONFIGS
        if only_default:
            configs = c_configs = [tuple(current.TMA_CONFIG), tuple(current.TMA_WIDE_CONFIG)]
        kernels += [(f"tma{cfg}", lambda m, cfg=cfg: m.sym_gemm_tma(x, x.mT, config=cfg)) for cfg in configs]
        if k == n:
            kernels += [
                (f"tma_addmm{cfg}", lambda m, cfg=cfg: m.sym_gemm_tma(x, x.mT, c, 0.5, -1.5, config=cfg))
                for cfg in c_configs
            ]
        cases = [("cublas_bmm", None, lambda m: torch.bmm(x, x.mT))]
        cases += cute_and_quack(x, c, want, want_c if k == n else None, shape, cute_variants, cute_base)
        for label, fn in kernels:
            for rev, mod in revisions:
                ref = want_c if label.startswith("tma_addmm") else want
                if _sym_checked(lambda: fn(mod), ref, f"{rev} {shape} {label}"):
                    cases.append((label, rev, fn))
        side = triton.cdiv(n, 128)
        sym_flop = 2 * L * k * n * n * (side + 1) / (2 * side)
        modules = [base if rev == "baseline" else current for _, rev, _ in cases]
        timings = _interleaved([lambda fn=fn, mod=mod: fn(mod) for (_, _, fn), mod in zip(cases, modules)], reps)
        for (label, rev, _), runs in zip(cases, timings):
            ms = statistics.median(runs)
            flop = 2 * L * n * n * k if label == "cublas_bmm" else sym_flop  # quack too: lower tiles
            rows.append({"L": L, "n": n, "k": k, "kernel": label, "revision": rev, "ms": ms, "ms_runs": runs})
            rows[-1].update(tflops=flop / ms / 1e9, dispatch=picks)
            print(
                f"L={L:3d} n={n:5d} k={k:5d} {label:24s} {rev or '':9s} {ms:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s",
                flush=True,
            )
    return rows


def _general_cases(a, b, c, alpha: float, beta: float, want, shape: str, cute_variants: list[str], cute_base) -> list:
    """(label, fn) of our CuteDSL kernel's general mode (``cute_symm.gemm``: its defaults, each
    of ``cute_variants``, the baseline revision's where given, with and without the finiteness
    check) and quack's GEMM (what gram-newton-schulz calls for X <- aX + BX, untuned), where
    importable, each result's difference to cuBLAS printed."""
    found = []
    try:
        from dion3_titan.kernels import cute_symm

        if cute_symm.is_available():
            found.append(("cute_gemm", lambda: cute_symm.gemm(a, b, c, alpha, beta)))
            found += [(f"cute_gemm({v})", _with_cute(v, found[0][1])) for v in cute_variants]
            flags = torch.zeros(a.shape[0], device=a.device, dtype=torch.int32)
            found.append(("cute_gemm_checked", lambda: cute_symm.gemm(a, b, c, alpha, beta, flags=flags)))
            if cute_base is not None:
                found.append(("cute_gemm[baseline]", lambda: cute_base.gemm(a, b, c, alpha, beta)))
                found.append(("cute_gemm_checked[baseline]", lambda: cute_base.gemm(a, b, c, alpha, beta, flags=flags)))
    except ImportError as exc:
        print(f"cute unavailable: {exc}")
    try:
        from quack.gemm_interface import gemm, gemm_add

        if c is None:
            found.append(("quack_gemm", lambda: gemm(a, b, tuned=False)))
        else:
            found.append(("quack_gemm_add", lambda: gemm_add(a, b, C=c, alpha=alpha, beta=beta, tuned=False)))
    except ImportError as exc:
        print(f"quack unavailable: {exc}")
    return _checked(found, want, shape)


def _checked(cases: list, want, shape: str) -> list:
    """The (label, fn) of ``cases`` that run and fit, each result's difference to cuBLAS's
    ``want`` printed (and why the others were left out)."""
    kept = []
    for label, fn in cases:
        try:
            got = fn()
        except Exception as exc:  # e.g. a variant that does not fit shared memory
            print(f"{shape} {label}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        if got is None:
            print(f"{shape} {label}: outside its limits")
            continue
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"{shape} {label}: rel. difference to cuBLAS {err:.2e}")
        kept.append((label, fn))
    return kept


def gemm_rows(shapes: list[str], reps: int, cute_variants: list[str], cute_base=None) -> list[dict]:
    rows = []
    for shape in shapes:
        with_c = shape.endswith("+c")
        L, M, K, N = (int(v) for v in shape.removesuffix("+c").split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(L, M, K, device="cuda", dtype=torch.float16, generator=gen) / K**0.5
        b = torch.randn(L, K, N, device="cuda", dtype=torch.float16, generator=gen)
        c = b if M == K else torch.randn(L, M, N, device="cuda", dtype=torch.float16, generator=gen)
        c = c if with_c else None
        alpha, beta = (1.0, 1.875) if with_c else (1.0, 0.0)
        if with_c:
            cases = [("cublas_baddbmm", lambda: torch.baddbmm(c, a, b, alpha=alpha, beta=beta))]
        else:
            cases = [("cublas_bmm", lambda: torch.bmm(a, b))]
        want = cases[0][1]()
        tma = [
            (f"mm_tma{cfg}", lambda cfg=cfg: triton_mm.mm_tma(a, b, c, alpha, beta, config=cfg)) for cfg in GEMM_CONFIGS
        ]
        cases += _checked(tma, want, shape)
        cases += _general_cases(a, b, c, alpha, beta, want, shape, cute_variants, cute_base)
        for (label, _), runs in zip(cases, _interleaved([fn for _, fn in cases], reps)):
            ms = statistics.median(runs)
            rows.append(
                {"shape": shape, "kernel": label, "ms": ms, "ms_runs": runs, "tflops": 2 * L * M * K * N / ms / 1e9}
            )
            print(f"{shape:22s} {label:48s} {ms:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default=None, help="a triton_ops.py of another revision")
    parser.add_argument(
        "--cute-baseline", default=None, help="a cute_symm.py of another revision, its cute_symm_sm90.py beside it"
    )
    parser.add_argument("--shapes", default="4x8192,32x2048", help="comma-separated LxN or LxNxK")
    parser.add_argument("--gemm", default="", help="comma-separated LxMxKxN[+c]")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--configs", default="all", choices=["all", "default"], help="symmetric TMA configs to time (see above)"
    )
    parser.add_argument(
        "--cute-variants",
        default="",
        help='comma-separated CuteDSL settings to time beside its defaults, e.g. "STAGES=5,PAIR_MIN_N=256+GROUP=4"',
    )
    args = parser.parse_args()
    base = load_revision(args.baseline, "baseline_triton_ops") if args.baseline else None
    cute_base = load_revision(args.cute_baseline, "baseline_cute_symm") if args.cute_baseline else None
    variants = [v for v in args.cute_variants.split(",") if v]
    shapes = [s for s in args.shapes.split(",") if s]
    rows = sym_rows(base, shapes, args.reps, args.configs == "default", variants, cute_base)
    gemm = gemm_rows([s for s in args.gemm.split(",") if s], args.reps, variants, cute_base)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    write_json(output_path(None, "bench_sym_ab.json"), {**meta, "rows": rows, "gemm": gemm})


if __name__ == "__main__":
    main()
