"""A/B timing of the Triton symmetric GEMM against another revision of it, in one run.

    git show REV:dion3_titan/kernels/triton_ops.py > /tmp/base_triton_ops.py
    python scripts/bench_sym_ab.py --baseline /tmp/base_triton_ops.py [--shapes 4x8192,32x2048] [--reps 5]

For each (L, n), k = n, fp16: cuBLAS bmm, then the persistent TMA kernel, the per-tile kernel and
the TMA kernel with C (alpha*AB + beta*C), baseline and current interleaved, each timed ``reps``
times with ``triton.testing.do_bench``; the median of those runs is reported. Both revisions'
results are checked for exact symmetry and equal lower triangles first. With $OUT set the rows
are also written to $OUT/bench_sym_ab.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import torch
import triton

from benchmarks.output import output_path, write_json
from benchmarks.timing import do_bench_ms
from dion3_titan.kernels import triton_ops as current


def _load(path: str):
    """The baseline revision's triton_ops.py, a file the caller extracted (see the docstring)."""
    spec = importlib.util.spec_from_file_location("baseline_triton_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="a triton_ops.py of another revision")
    parser.add_argument("--shapes", default="4x8192,32x2048", help="comma-separated LxN")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    base = _load(args.baseline)
    rows = []
    for shape in args.shapes.split(","):
        L, n = (int(v) for v in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(L, n, n, device="cuda", dtype=torch.float16, generator=gen) / n**0.5
        c = torch.randn(L, n, n, device="cuda", dtype=torch.float16, generator=gen)
        c = (c + c.mT) / 2
        for name, mod in [("baseline", base), ("current", current)]:
            y = mod.sym_gemm_tma(x, x.mT)
            print(
                f"{name} L={L} n={n}: symmetric {torch.equal(y, y.mT)}, "
                f"lower = current's {torch.equal(y.tril(), current.sym_gemm_tma(x, x.mT).tril())}"
            )
        cases = [("cublas_bmm", None, lambda m: torch.bmm(x, x.mT))]
        for label, fn in [
            ("tma", lambda m: m.sym_gemm_tma(x, x.mT)),
            ("tile", lambda m: m.sym_gemm(x, x.mT, config=m.SYM_CONFIG)),
            ("tma_addmm", lambda m: m.sym_gemm_tma(x, x.mT, c, 0.5, -1.5)),
        ]:
            cases += [(label, "baseline", fn), (label, "current", fn)]
        for label, rev, fn in cases:
            mod = base if rev == "baseline" else current
            runs = [do_bench_ms(lambda: fn(mod), rep=300, return_mode="mean") for _ in range(args.reps)]
            rows.append(
                {"L": L, "n": n, "kernel": label, "revision": rev, "ms": statistics.median(runs), "ms_runs": runs}
            )
            print(f"L={L:3d} n={n:5d} {label:10s} {rev or '':9s} {rows[-1]['ms']:.3f} ms", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    write_json(output_path(None, "bench_sym_ab.json"), {**meta, "rows": rows})


if __name__ == "__main__":
    main()
