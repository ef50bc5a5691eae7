"""Benchmark orthogonalization and the symmetric GEMM on one CUDA GPU.

One run prints, per (batch x n x m) shape: plain-PyTorch Muon NS5 (bf16, bmm/baddbmm), our
Gram NS per backend (torch, triton, cute when available) through ``orthogonalize``, what
``ns_algorithm = "auto"`` runs (standard NS on square shapes) on the Triton and CuteDSL backends
and on the backend ``backend = "auto"`` picks for the shape (the optimizer's choice), eager and
replayed from a CUDA graph, the gram-newton-schulz package (with quack kernels) when importable,
and the FLOP floor (kernels/flops.py, symmetric products at half cost, of the real unpadded
shape) at two dense fp16 rates measured in the same run: 8192^3 and a batched product of the
shape's own size, (batch, n, n) @ (batch, n, m). ``--variants`` also times "auto" with kernel
switches turned (the Triton GEMM of kernels/triton_mm.py for A @ B + C, A @ B or both, in place
of cuBLAS; the CuteDSL general mode off; the batch in one piece rather than in halves on two
streams; with ``--cute-baseline``, another revision's CuteDSL kernels) in the same run, and in
the alternating rounds of ``--rounds``.
Then the symmetric GEMM against cuBLAS bmm/baddbmm at batch 4, n = 2048, 4096, 8192 (k = n).
Times are medians of ``triton.testing.do_bench`` (CUDA events) after warm-up, on random inputs.
A table is printed at the end; with $OUT set, everything is also written to
$OUT/bench_orthogonalize.json.

    python scripts/bench_orthogonalize.py [--sweep] [--budget-s 150] [--skip-anchor]
        [--shapes 32x2048x2048,16x2752x4096] [--variants cublas_mm_add,sym_4warps] [--rounds 6] [--profile 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton

from benchmarks.machine import card_state
from benchmarks.output import fmt, output_path, write_json
from benchmarks.revision import load_revision
from benchmarks.timing import do_bench_ms as bench
from benchmarks.timing import graph_ms, matmul_tflops
from dion3_titan.kernels import cute_symm, triton_mm, triton_ops
from dion3_titan.kernels.dispatch import get_backend, select_backend
from dion3_titan.kernels.flops import ns_flops
from dion3_titan.optim import orthogonalize as orthogonalize_module
from dion3_titan.optim.config import MUON_QUINTIC, coefficient_schedule
from dion3_titan.optim.orthogonalize import NSSettings, orthogonalize

SHAPES = "32x2048x7168,1x7168x18432,4x4096x11008,8x4096x4096,24x1024x4096,4x1024x11008"
# The kernel switches --variants turns, each against the module defaults: (module, name, value).
_WIDE = triton_mm.DEFAULT_CONFIG  # the config that measured fastest
VARIANTS = {
    "cublas_mm_add": [(triton_mm, "MM_ADD_CONFIG", None)],
    "mm_add_no_ws": [(triton_mm, "MM_ADD_CONFIG", triton_mm.Config(128, 256, 64, 8, 8, 3))],
    "triton_mm": [(triton_mm, "MM_CONFIG", _WIDE)],
    "sym_4warps": [(triton_ops, "TMA_CONFIG", triton_ops.TmaConfig(128, 64, 8, 4, 4))],
    "sym_ws": [(triton_ops, "TMA_CONFIG", triton_ops.TmaConfig(128, 64, 8, 8, 4, ws=True))],
    "sym_narrow": [(triton_ops, "TMA_WIDE_CONFIG", None)],
    "sym_wide_all": [(triton_ops, "TMA_WIDE_MIN_N", 0)],
    "sym_tile_only": [(triton_ops, "TMA_MIN_KSTEPS_PER_SM", 2**40)],
    # CuteDSL backend switches (timed on the cute backend)
    "cute_no_general": [(cute_symm, "GENERAL", 0)],
    # a pair's diagonal tiles computed whole, the block above the diagonal dropped after
    "cute_full_diagonal": [(cute_symm, "HALF_DIAGONAL", False)],
    # the products over a padded Gram side read the whole side, zero rows included
    "cute_whole_side": [(cute_symm, "SKIP_PADDING", False)],
    # the padding rows' warpgroups multiply their zeros; the skipping kernel given a bound no
    # warpgroup reaches (what the skipping path costs where it is not taken)
    "cute_zero_rows_multiplied": [(cute_symm, "SKIP_ZERO_ROWS", False)],
    "cute_skip_never_taken": [(cute_symm, "SKIP_NEVER", True)],
    # the batch in one piece on one stream, not in halves on two (optim/orthogonalize.py)
    "cute_one_batch": [(orthogonalize_module, "HALVES_MIN_FLOPS", float("inf"))],
}
SYM_SIDES = (2048, 4096, 8192)
SWEEP = [  # (BLOCK, BLOCK_K, GROUP, num_warps, num_stages)
    (128, 64, 8, 8, 3),
    (128, 64, 8, 8, 4),
    (128, 64, 1, 8, 3),
    (128, 64, 16, 8, 4),
    (128, 32, 8, 8, 5),
    (128, 64, 8, 4, 3),
    (128, 128, 8, 8, 2),
    (64, 64, 8, 4, 4),
]


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    """Measured dense matmul TFLOP/s on random data (the ceiling for the floors below)."""
    return matmul_tflops(torch.device("cuda"), dtype, batch=1, n=n, timer=bench)


def muon_ns5(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Plain Muon Newton-Schulz in bf16 with torch.bmm/baddbmm (Jordan et al.'s quintic)."""
    a, b, c = MUON_QUINTIC
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(torch.bfloat16)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x.mT if tall else x


def floor_ms(batch: int, n: int, m: int, tflops: float) -> float:
    """The batch's NS FLOPs as "auto" runs it (5 steps, restart at 2, symmetric products at
    half cost) at ``tflops``."""
    return batch * ns_flops(n, m, "auto", 5, (2,), symmetric=True) / (tflops * 1e12) * 1e3


def shape_rate(batch: int, n: int, m: int) -> float:
    """Dense fp16 TFLOP/s of a plain batched product of the shape's size, (batch, n, n) @
    (batch, n, m) with n <= m: the ceiling a kernel of these sides could reach."""
    n, m = min(n, m), max(n, m)
    a = torch.randn(batch, n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(batch, n, m, device="cuda", dtype=torch.float16)
    return 2 * batch * n * n * m / bench(lambda: torch.bmm(a, b)) / 1e9


def variant_backend(variant: str) -> str:
    """The backend a --variants entry is timed on."""
    return "cute" if variant.startswith("cute_") else "triton"


def interleaved(rows: list[dict], rounds: int, auto: NSSettings, ops: dict, anchor, variants: list[str]) -> None:
    """Per shape, what ``ns_algorithm = "auto"`` runs on each kernel backend, and the anchor,
    timed ``rounds`` times in alternating order (A B C, C B A, ...); each row gets the medians
    and every timing under "interleaved", and its backends' and the chosen one's ratio to the
    anchor from those medians. One column's single timing drifts by up to 5-10% over a call on
    these cards, more than the differences "auto"'s table is chosen from. The dense 8192^3 fp16
    product runs in the same rounds ("dense"): under the card's power limit its rate depends on
    the card's state as much as ours does, so each row also gets its share of that rate."""
    dense_n = 8192
    a = torch.randn(1, dense_n, dense_n, device="cuda", dtype=torch.float16)
    b = torch.randn(1, dense_n, dense_n, device="cuda", dtype=torch.float16)
    for row in rows:
        batch, n, m = (int(v) for v in row["shape"].split("x"))
        x = torch.randn(batch, n, m, device="cuda", dtype=torch.bfloat16)
        fns = {name: (lambda be=be, x=x: orthogonalize(x, auto, be)) for name, be in ops.items() if name != "torch"}
        for variant in variants:
            name = variant_backend(variant)
            if name in ops:

                def run(x=x, be=ops[name], changes=VARIANTS[variant]):
                    with switched(changes):
                        return orthogonalize(x, auto, be)

                fns[f"{name}[{variant}]"] = run
        if anchor is not None and "gram_newton_schulz" in row:
            fns["anchor"] = lambda x=x: anchor(x)
        fns["dense"] = lambda: torch.bmm(a, b)
        times: dict[str, list[float]] = {name: [] for name in fns}
        cards: dict[str, list[dict | None]] = {name: [] for name in fns}
        for r in range(rounds):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                times[name].append(bench(fns[name]))
                cards[name].append(card_state(torch.cuda.current_device()))  # right after its timing
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        row["interleaved"] = {"rounds": rounds, "median": medians, "all": times, "card_after": cards}
        chosen = row.get("auto_backend")
        dense_tflops = 2 * dense_n**3 / medians["dense"] / 1e9
        row["interleaved"]["dense_fp16_tflops"] = dense_tflops
        if "anchor" in medians:
            for name in medians:
                if name not in ("anchor", "dense"):
                    row["interleaved"][f"{name}_vs_anchor"] = medians[name] / medians["anchor"]
        if chosen in medians:
            row["interleaved"]["auto"] = medians[chosen]
            row["interleaved"]["fraction_of_dense"] = row["floor_ms"] / medians[chosen]
            floor = floor_ms(batch, n, m, dense_tflops)
            row["interleaved"]["fraction_of_dense_same_rounds"] = floor / medians[chosen]
        spread = {name: f"{min(ts):.2f}-{max(ts):.2f}" for name, ts in times.items()}
        print("interleaved", row["shape"], json.dumps(medians), "range", json.dumps(spread), flush=True)
        clocks = {name: [c["sm_mhz"] if c else None for c in states] for name, states in cards.items()}
        print("  SM MHz after each timing", json.dumps(clocks), flush=True)
        shares = {k: round(v, 3) for k, v in row["interleaved"].items() if k.startswith("fraction_of_dense")}
        print(f"  dense fp16 in these rounds {dense_tflops:.0f} TFLOP/s; shares {json.dumps(shares)}", flush=True)
        del x
        torch.cuda.empty_cache()


def profiled(rows: list[dict], auto: NSSettings, anchor, top: int) -> None:
    """Per shape, one call of what ``backend = "auto"`` runs and one of the anchor traced
    (torch.profiler, device activity): the kernels by total time, where the time beyond the
    products goes. Each row gets them under "profile"."""
    from benchmarks.timeline import report, summarize, trace_once

    for row in rows:
        batch, n, m = (int(v) for v in row["shape"].split("x"))
        x = torch.randn(batch, n, m, device="cuda", dtype=torch.bfloat16)
        chosen = select_backend("auto", (batch, n, m), torch.float16, x.device)
        fns = {f"auto ({chosen.name})": lambda x=x, chosen=chosen: orthogonalize(x, auto, chosen)}
        if anchor is not None and "gram_newton_schulz" in row:
            fns["anchor"] = lambda x=x: anchor(x)
        row["profile"] = {}
        for name, fn in fns.items():
            fn()  # compiled and warm
            spans = trace_once(fn)
            summary = summarize(spans)
            print(f"profile {row['shape']} {name}:")
            print("\n".join(report(summary, spans, top, 0)), flush=True)
            row["profile"][name] = {"busy_ms": summary.union_busy_us / 1e3, "kernels": summary.by_name[:top]}
        del x
        torch.cuda.empty_cache()


class switched:
    """Context manager: the module attributes of one VARIANTS entry set, then restored."""

    def __init__(self, changes: list) -> None:
        self.changes = changes

    def __enter__(self) -> None:
        self.saved = [(mod, name, getattr(mod, name)) for mod, name, _ in self.changes]
        for mod, name, value in self.changes:
            setattr(mod, name, value)

    def __exit__(self, *exc) -> None:
        for mod, name, value in self.saved:
            setattr(mod, name, value)


def baseline_switches(path: str) -> list:
    """The VARIANTS entry that runs another revision's CuteDSL kernels (its ``cute_symm.py`` at
    ``path``) in place of ours: the backend calls them through these module names."""
    base = load_revision(path, "baseline_cute_symm")
    return [(cute_symm, "gemm", base.gemm), (cute_symm, "sym_gemm", base.sym_gemm)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def load_anchor():
    """gram-newton-schulz with quack kernels, eager (no torch.compile: its compile time would
    dominate one run). None if it is not importable here."""
    try:
        from gram_newton_schulz import GramNewtonSchulz

        return GramNewtonSchulz(ns_use_kernels=True, compile_kwargs=None)
    except Exception as exc:  # any import/setup failure just drops the anchor column
        print(f"[anchor] gram-newton-schulz unavailable: {type(exc).__name__}: {exc}")
        return None


def backends(names: list[str]) -> dict[str, object]:
    found = {}
    for name in names:
        try:
            found[name] = get_backend(name)
        except Exception as exc:  # e.g. cute without CuteDSL: drop the column, say why
            print(f"[{name}] unavailable: {exc}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time Triton tile configs")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip remaining work after this")
    parser.add_argument("--skip-anchor", action="store_true")
    parser.add_argument("--crossover", action="store_true", help="small shapes: torch vs triton Gram NS")
    parser.add_argument("--backends", default="torch,triton,cute", help="comma-separated backends to time")
    parser.add_argument("--parts", default="sym,ns", help="sym (GEMM vs cuBLAS), ns (orthogonalize)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated BxNxM")
    parser.add_argument("--variants", default="", help=f"comma-separated, of {sorted(VARIANTS)}")
    parser.add_argument("--no-ns5", action="store_true", help="skip plain Muon NS5")
    parser.add_argument(
        "--cute-baseline",
        default=None,
        help="a cute_symm.py of another revision, its cute_symm_sm90.py beside it: adds the variant "
        "cute_baseline (its kernels in ours' place)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="then time what 'auto' runs on each backend and the anchor again, this many rounds in "
        "alternating order (medians: a card's drift weighs on every column alike)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="then trace one call of 'auto' and of the anchor: this many kernels"
    )
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    result: dict = {
        "device": dev,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    rate = {str(dt): matmul_rate(dt) for dt in (torch.bfloat16, torch.float16)}
    result["matmul_tflops"] = rate
    print(f"{dev}: matmul 8192^3 bf16 {rate['torch.bfloat16']:.0f} TFLOP/s, fp16 {rate['torch.float16']:.0f} TFLOP/s")
    ops = backends(args.backends.split(","))
    parts = args.parts.split(",")

    # ---- symmetric GEMM vs cuBLAS, batch 4, (n x n) @ (n x n)^T and alpha AB + beta C

    sym_rows = []
    for n in SYM_SIDES if "sym" in parts else ():
        x = torch.randn(4, n, n, device="cuda", dtype=torch.float16)
        c = torch.randn(4, n, n, device="cuda", dtype=torch.float16)
        c = (c + c.mT) / 2
        row = {
            "n": n,
            "cublas_bmm": bench(lambda: torch.bmm(x, x.mT)),
            "cublas_baddbmm": bench(lambda: torch.baddbmm(c, x, x.mT, beta=0.5, alpha=1.5)),
        }
        for name, be in ops.items():
            if name == "torch":
                continue
            row[f"{name}_sym_mm"] = bench(lambda: be.sym_mm(x, x.mT))
            row[f"{name}_sym_addmm"] = bench(lambda: be.sym_addmm(x, x.mT, c, 1.5, 0.5))
        if args.sweep and n >= 4096:
            for cfg in SWEEP:
                try:
                    row[f"triton{cfg}"] = bench(lambda: triton_ops.sym_gemm(x, x.mT, config=cfg))
                except Exception as exc:
                    row[f"triton{cfg}"] = f"{type(exc).__name__}"
            if n == max(SYM_SIDES):
                # adopt the fastest config for the rest of this run (reported; docs/kernels.md)
                timed = {cfg: row[f"triton{cfg}"] for cfg in SWEEP if isinstance(row[f"triton{cfg}"], float)}
                best = min(timed, key=timed.get)
                if timed[best] < 0.97 * timed.get(triton_ops.SYM_CONFIG, float("inf")):
                    print(f"[sweep] SYM_CONFIG {triton_ops.SYM_CONFIG} -> {best}")
                    triton_ops.SYM_CONFIG = best
                result["sym_config"] = list(triton_ops.SYM_CONFIG)
        flops = 4 * 2 * n**3
        row["cublas_tflops"] = flops / row["cublas_bmm"] / 1e9
        for name in ops:
            if f"{name}_sym_mm" in row:  # effective rate, counting the full GEMM's FLOPs
                row[f"effective_tflops_{name}"] = flops / row[f"{name}_sym_mm"] / 1e9
        print("sym", json.dumps(row))
        sym_rows.append(row)
        x = c = None  # the next side allocates its own
    result["sym_gemm"] = sym_rows

    # ---- orthogonalization per shape
    coefs = coefficient_schedule("polar_express", 5, 1.05)
    gram = NSSettings(algorithm="gram", coefficients=coefs, restarts=(2,), dtype=torch.float16)
    std = NSSettings(algorithm="standard", coefficients=coefs, restarts=(), dtype=torch.float16)
    auto = NSSettings(algorithm="auto", coefficients=coefs, restarts=(2,), dtype=torch.float16)
    anchor = None if args.skip_anchor else load_anchor()
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    if args.cute_baseline:
        VARIANTS["cute_baseline"] = baseline_switches(args.cute_baseline)
        variants.append("cute_baseline")
    ns_rows = []
    for batch, n, m in shapes if "ns" in parts else ():
        if time.time() - start > args.budget_s:
            print(f"[budget] skipping {batch}x{n}x{m}")
            continue
        x = torch.randn(batch, n, m, device="cuda", dtype=torch.bfloat16)
        row = {"shape": f"{batch}x{n}x{m}", "floor_ms": floor_ms(batch, n, m, rate["torch.float16"])}
        row["shape_fp16_tflops"] = shape_rate(batch, n, m)
        row["floor_shape_rate_ms"] = floor_ms(batch, n, m, row["shape_fp16_tflops"])
        if not args.no_ns5:
            row["muon_ns5_bf16"] = bench(lambda: muon_ns5(x))
        ref = orthogonalize(x, gram, get_backend("torch"))
        for name, be in ops.items():
            row[f"gram_{name}"] = bench(lambda: orthogonalize(x, gram, be))
            if name != "torch":
                row[f"gram_{name}_vs_torch_relerr"] = rel(orthogonalize(x, gram, be), ref)
        if "triton" in ops:
            tri = ops["triton"]
            row["standard_triton"] = bench(lambda: orthogonalize(x, std, tri))
            row["auto_triton"] = bench(lambda: orthogonalize(x, auto, tri))
            row["auto_triton_vs_torch_relerr"] = rel(
                orthogonalize(x, auto, tri), orthogonalize(x, auto, get_backend("torch"))
            )
            if "cute" in ops:
                row["auto_cute"] = bench(lambda: orthogonalize(x, auto, ops["cute"]))
                row["auto_cute_vs_torch_relerr"] = rel(
                    orthogonalize(x, auto, ops["cute"]), orthogonalize(x, auto, get_backend("torch"))
                )
            # what the optimizer runs: backend = "auto" picks per shape (kernels/dispatch.py)
            chosen = select_backend("auto", (batch, n, m), torch.float16, x.device)
            row["auto_backend"] = chosen.name
            row["auto"] = bench(lambda: orthogonalize(x, auto, chosen))
            row["auto_graph"] = graph_ms(lambda: orthogonalize(x, auto, chosen), reps=20)
            row["fraction_of_dense"] = row["floor_ms"] / row["auto"]
            for variant in variants:
                name = variant_backend(variant)
                if name in ops:
                    with switched(VARIANTS[variant]):
                        row[f"auto_{name}[{variant}]"] = bench(lambda: orthogonalize(x, auto, ops[name]))
        print("ns", json.dumps(row))
        ns_rows.append(row)
        del x, ref
        torch.cuda.empty_cache()
    # the anchor last: its kernels compile on first use, which may eat the rest of the budget
    for row in ns_rows if anchor is not None else []:
        if time.time() - start > args.budget_s:
            print(f"[budget] anchor skipped for {row['shape']}")
            continue
        batch, n, m = (int(v) for v in row["shape"].split("x"))
        x = torch.randn(batch, n, m, device="cuda", dtype=torch.bfloat16)
        try:
            row["gram_newton_schulz_vs_torch_relerr"] = rel(anchor(x), orthogonalize(x, gram, get_backend("torch")))
            row["gram_newton_schulz"] = bench(lambda: anchor(x))
        except Exception as exc:
            print(f"[anchor] failed on {row['shape']}: {type(exc).__name__}: {exc}")
            break
        if "auto" in row:
            row["auto_vs_anchor"] = row["auto"] / row["gram_newton_schulz"]
        print("anchor", row["shape"], row["gram_newton_schulz"])
        del x
    result["orthogonalize"] = ns_rows
    if args.rounds and "triton" in ops:
        interleaved(ns_rows, args.rounds, auto, ops, anchor, variants)
    if args.profile and "auto" in (ns_rows[0] if ns_rows else {}):
        profiled(ns_rows, auto, anchor, args.profile)

    # ---- small shapes: where a kernel backend starts to pay (dispatch.TRITON_MIN_N), eager
    # (do_bench: the host's launches show at these sizes) and captured in a CUDA graph (device
    # time only); the last three are the small Gram sides of llama3-1B's step at f = 1/4
    cross_rows = []
    small = ((64, 256, 1024), (32, 512, 2048), (16, 768, 3072), (16, 1024, 4096), (8, 1536, 6144))
    small += ((32, 256, 2048), (16, 512, 8192))
    for batch, n, m in small if args.crossover else ():
        x = torch.randn(batch, n, m, device="cuda", dtype=torch.bfloat16)
        row = {"shape": f"{batch}x{n}x{m}"}
        for name in ("torch", "triton"):
            row[f"gram_{name}"] = bench(lambda: orthogonalize(x, gram, get_backend(name)))
            row[f"gram_{name}_graph"] = graph_ms(lambda: orthogonalize(x, gram, get_backend(name)), 30)
        print("cross", json.dumps(row))
        cross_rows.append(row)
    result["crossover"] = cross_rows

    # ---- table
    print(f"\n{dev} | matmul fp16 {rate['torch.float16']:.0f} TFLOP/s | times in ms (median)")
    cols = [
        "floor_ms",
        "muon_ns5_bf16",
        "gram_torch",
        "gram_triton",
        "gram_cute",
        "standard_triton",
        "auto_triton",
        "auto_cute",
        "auto",
        "auto_graph",
        "gram_newton_schulz",
        "auto_vs_anchor",
        "fraction_of_dense",
    ] + [f"auto_{variant_backend(v)}[{v}]" for v in variants]
    print(f"{'shape':>14} " + " ".join(f"{c[-15:]:>15}" for c in cols))
    for row in ns_rows:
        print(f"{row['shape']:>14} " + " ".join(fmt(row.get(c), ".2f", 15) for c in cols))
    print(
        f"\n{'sym n (b=4)':>14} {'cuBLAS bmm':>12} {'triton sym':>12} {'cute sym':>12} "
        f"{'cuBLAS addmm':>12} {'triton addmm':>12} {'speedup':>8}"
    )

    def cell(v: object) -> str:
        return fmt(v, ".3f", 12)

    for row in sym_rows:
        best = min((v for k, v in row.items() if k.endswith("_sym_mm")), default=float("nan"))
        print(
            f"{row['n']:>14} {cell(row['cublas_bmm'])} {cell(row.get('triton_sym_mm'))} "
            f"{cell(row.get('cute_sym_mm'))} {cell(row['cublas_baddbmm'])} "
            f"{cell(row.get('triton_sym_addmm'))} {row['cublas_bmm'] / best:8.2f}"
        )
    write_json(output_path(None, f"bench_orthogonalize{args.tag}.json"), result)
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
