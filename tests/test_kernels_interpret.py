"""Triton kernels' logic on CPU through Triton's interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when it is imported, so the checks run in one child process that
imports Triton with it set (this file run as a script) and reports a JSON line per check; the
tests below assert on those lines. Small shapes and small tiles keep it well under a minute.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# (L, n, k, config) with config = (BLOCK, BLOCK_K, GROUP, num_warps, num_stages)
SYM_CASES = [
    (2, 40, 24, (16, 16, 2, 4, 2)),  # n, k not multiples of the tile
    (1, 70, 33, (16, 16, 3, 4, 2)),  # partial band of tile rows
    (3, 64, 32, (16, 16, 1, 4, 2)),  # exact multiples, row-major order
    (1, 130, 64, None),  # the GPU tile shape (128) with a ragged edge
]
# Gram Newton-Schulz through the Triton backend: (batch, rows, cols)
GRAM_NS_CASES = {"wide": (1, 24, 80), "tall": (1, 96, 40), "batched": (3, 32, 48)}


# ---------------------------------------------------------------- child process (interpreter)
def _run_checks(seed: int) -> list[dict]:
    import torch

    from dion3_titan.kernels import triton_ops
    from dion3_titan.kernels.torch_ops import TorchOps, _fused_update_reference

    torch.manual_seed(seed)  # fresh inputs each session (conftest's seed, replayable)
    results: list[dict] = []

    def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
        return ((out.double() - ref).norm() / ref.norm()).item()

    # the triangular tile schedule: every lower tile exactly once, none above the diagonal
    for side, group in [(1, 1), (7, 1), (7, 3), (9, 4), (20, 8), (45, 8), (45, 16), (64, 8)]:
        ij = triton_ops.tile_order(side, group)
        expected = {(i, j) for i in range(side) for j in range(i + 1)}
        got = [tuple(p) for p in ij.tolist()]
        results.append({"check": "tiles", "case": f"side={side},group={group}", "ok": sorted(got) == sorted(expected)})
    # wide tiles (BLOCK x 2 BLOCK): every (row, pair column) with pair <= row // 2 exactly once
    for side, group in [(1, 2), (2, 2), (3, 2), (7, 2), (7, 4), (9, 4), (20, 8), (45, 8), (45, 16), (64, 8)]:
        got = [tuple(p) for p in triton_ops.tile_order(side, group, wide=True).tolist()]
        expected = {(i, p) for i in range(side) for p in range(i // 2 + 1)}
        ok = sorted(got) == sorted(expected) and len(got) == triton_ops.wide_tiles(side)
        results.append({"check": "tiles", "case": f"wide,side={side},group={group}", "ok": ok})

    for L, n, k, config in SYM_CASES:
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(L, n, k).to(dtype)
            layouts = {"x,x.mT": (x, x.mT), "xT.mT,xT": (x.mT.contiguous().mT, x.mT.contiguous())}
            for layout, (a, b) in layouts.items():
                for with_c in (False, True):
                    ref = torch.bmm(a.double(), b.double())
                    c = None
                    alpha, beta = 1.0, 0.0
                    theirs = torch.bmm(a, b)
                    if with_c:
                        alpha, beta = 0.7, -1.3
                        c = torch.randn(L, n, n)
                        c = ((c + c.mT) / 2).to(dtype)
                        ref = alpha * ref + beta * c.double()
                        theirs = torch.baddbmm(c, a, b, alpha=alpha, beta=beta)
                    out = torch.full((L, n, n), float("nan"), dtype=dtype)  # poisoned
                    triton_ops.sym_gemm(a, b, c, alpha, beta, config=config, out=out)
                    results.append(
                        {
                            "check": "sym_gemm",
                            "case": f"L={L},n={n},k={k},{dtype},{layout},c={with_c}",
                            "err": rel(out, ref),
                            "torch_err": rel(theirs, ref),
                            "finite": bool(torch.isfinite(out).all()),
                            "symmetric": bool(torch.equal(out, out.mT)),
                            "dtype_ok": out.dtype == dtype,
                        }
                    )

    # the persistent TMA kernel (even shapes only), for every operand layout Gram NS passes; the
    # second case with the warp-specialization flag set, the last two with wide tiles (an odd
    # and an even number of tile rows)
    for L, n, k, tma_config in [
        (2, 48, 32, (16, 16, 2, 4, 2)),
        (1, 64, 16, (16, 16, 2, 4, 2, True)),
        (2, 48, 32, (16, 16, 2, 4, 2, False, True)),
        (1, 64, 16, (16, 16, 4, 4, 2, True, True)),
    ]:
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(L, n, k).to(dtype)
            r = torch.randn(L, n, n)
            r = ((r + r.mT) / 2).to(dtype)
            layouts = {"x,x.mT": (x, x.mT), "xT.mT,xT": (x.mT.contiguous().mT, x.mT.contiguous()), "r,r": (r, r)}
            for layout, (a, b) in layouts.items():
                for with_c in (False, True):
                    c, alpha, beta = (r, 0.7, -1.3) if with_c else (None, 1.0, 0.0)
                    ref = alpha * torch.bmm(a.double(), b.double()) + (beta * c.double() if with_c else 0)
                    theirs = torch.baddbmm(c, a, b, alpha=alpha, beta=beta) if with_c else torch.bmm(a, b)
                    out = torch.full((L, n, n), float("nan"), dtype=dtype)
                    done = triton_ops.sym_gemm_tma(a, b, c, alpha, beta, config=tma_config, out=out)
                    fresh = triton_ops.sym_gemm_tma(a, b, c, alpha, beta, config=tma_config)  # allocates
                    results.append(
                        {
                            "check": "tma_alloc",
                            "case": f"L={L},n={n},{dtype},{layout},c={with_c}",
                            "ok": fresh is not None and torch.equal(fresh, out),
                        }
                    )
                    results.append(
                        {
                            "check": "sym_gemm",
                            "case": f"tma,L={L},n={n},k={k},{dtype},{layout},c={with_c}",
                            "err": rel(out, ref) if done is not None else float("inf"),
                            "torch_err": rel(theirs, ref),
                            "finite": bool(torch.isfinite(out).all()),
                            "symmetric": bool(torch.equal(out, out.mT)),
                            "dtype_ok": out.dtype == dtype,
                        }
                    )
    # the persistent GEMM alpha * A @ B + beta * C (triton_mm), blocks of unequal sides, every
    # operand in either memory order, into a poisoned output
    from dion3_titan.kernels import triton_mm

    # triton_mm.Config: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP, warps, stages[, split, ws])
    for L, M, K, N, mm_config in [
        (2, 32, 48, 64, (16, 32, 16, 2, 4, 2)),
        (2, 32, 48, 64, (16, 32, 16, 2, 4, 2, True, True)),  # the epilogue in two halves
        (1, 16, 16, 32, (16, 16, 16, 1, 4, 2)),
    ]:
        for dtype in (torch.float16, torch.bfloat16):
            a, b, c = (torch.randn(*s).to(dtype) for s in [(L, M, K), (L, K, N), (L, M, N)])
            for layout in ("rows", "cols"):
                if layout == "cols":
                    a, b, c = (t.mT.contiguous().mT for t in (a, b, c))
                for with_c in (False, True):
                    alpha, beta = (0.7, -1.3) if with_c else (1.0, 0.0)
                    ref = alpha * torch.bmm(a.double(), b.double()) + (beta * c.double() if with_c else 0)
                    theirs = torch.baddbmm(c, a, b, alpha=alpha, beta=beta) if with_c else torch.bmm(a, b)
                    out = torch.full((L, M, N), float("nan"), dtype=dtype)
                    done = triton_mm.mm_tma(a, b, c if with_c else None, alpha, beta, config=mm_config, out=out)
                    results.append(
                        {
                            "check": "mm_tma",
                            "case": f"L={L},M={M},K={K},N={N},{dtype},{layout},c={with_c},{mm_config}",
                            "ran": done is out,
                            "err": rel(out, ref),
                            "torch_err": rel(theirs, ref),
                            "finite": bool(torch.isfinite(out).all()),
                        }
                    )
    x = torch.randn(1, 40, 32).half()
    results.append({"check": "mm_declines", "case": "M=40", "ok": triton_mm.mm_tma(x, x.mT, config=mm_config) is None})
    results += _flag_checks(triton_mm)
    # persistent kernels on fewer programs than SMs (tma.leave_sms, the overlapped step's NS
    # stream): every tile once, the same bits; interpreted, a CPU "device" has 4 SMs
    from dion3_titan.kernels.tma import grid_sms, leave_sms

    x, y = torch.randn(3, 48, 32).half(), torch.randn(3, 32, 64).half()
    products = {
        "sym": lambda: triton_ops.sym_gemm_tma(x, x.mT, config=(16, 16, 2, 4, 2)),
        "mm": lambda: triton_mm.mm_tma(x, y, config=(16, 32, 16, 2, 4, 2)),
    }
    for name, product in products.items():
        full = product()
        for left in (1, 3):
            with leave_sms(left):
                fewer, programs = product(), grid_sms(x.device)
            ok = full is not None and fewer is not None and torch.equal(full, fewer) and programs == 4 - left
            results.append({"check": "leave_sms", "case": f"{name},left={left}", "ok": ok})
    x = torch.randn(1, 40, 32).half()  # n not a multiple of the tile: the general kernel's job
    results.append(
        {"check": "tma_declines", "case": "n=40", "ok": triton_ops.sym_gemm_tma(x, x.mT, config=tma_config) is None}
    )

    ops = triton_ops.TritonOps()
    for dtype in (torch.float32, torch.bfloat16):
        for decay in (1.0, 0.98):
            for k in (0, 5, 37):
                B, R, C = 3, 37, 300
                base = torch.randn(B, R, 2 * C).to(dtype)
                weight = base[:, :, ::2]  # strided view
                rows = torch.stack([torch.randperm(R)[:k] for _ in range(B)]).reshape(B, k)
                update = torch.randn(B, k, C)
                lr, dec = torch.tensor(0.0173), torch.tensor(decay)
                expected = weight.clone()
                _fused_update_reference(expected, update, rows, lr, dec)
                other = base[:, :, 1::2].clone()
                ops.fused_update(weight, update, rows, lr, dec)
                results.append(
                    {
                        "check": "fused_update",
                        "case": f"{dtype},decay={decay},k={k}",
                        "bitwise": bool(torch.equal(weight, expected)),
                        "view_only": bool(torch.equal(base[:, :, 1::2], other)),
                    }
                )

    # Gram NS end to end (fp16, the default coefficients and restart): the Triton backend against
    # the torch backend, both measured against the float64 result; the default tile config
    from dion3_titan.optim.config import Dion3Config
    from dion3_titan.optim.orthogonalize import NSSettings, orthogonalize

    class CountingTriton(triton_ops.TritonOps):
        calls = ran = 0  # symmetric products asked for, and run by a Triton kernel

        def sym_mm(self, a, b, zero_from=None):
            self.calls, self.ran = self.calls + 1, self.ran + self._runs(a)
            return super().sym_mm(a, b, zero_from)

        def sym_addmm(self, a, b, c, alpha, beta, zero_from=None):
            self.calls, self.ran = self.calls + 1, self.ran + self._runs(a)
            return super().sym_addmm(a, b, c, alpha, beta, zero_from)

    cfg = Dion3Config()
    fp16 = NSSettings("gram", cfg.coefficients(), cfg.ns_restarts, torch.float16, cfg.ns_eps)
    fp64 = NSSettings("gram", cfg.coefficients(), cfg.ns_restarts, torch.float64, cfg.ns_eps)
    for label, shape in GRAM_NS_CASES.items():
        x = torch.randn(*shape)
        want = orthogonalize(x.double(), fp64, TorchOps())
        counting = CountingTriton()
        out = orthogonalize(x, fp16, counting)
        theirs = orthogonalize(x, fp16, TorchOps())
        results.append(
            {
                "check": "gram_ns",
                "case": f"{label},{tuple(shape)}",
                "err": rel(out, want),
                "torch_err": rel(theirs, want),
                "vs_torch": rel(out, theirs.double()),
                "products": counting.calls,
                "triton_products": counting.ran,
                "shape_ok": out.shape == x.shape and out.dtype == torch.float16,
            }
        )

    results += _result_check_checks(triton_ops, fp16)

    # Newton-Schulz's input: the Triton backend's one-pass normalization (the row engine's
    # gather) against the reference's division, bit for bit, in the same memory order, zero rows
    # appended; contiguous and transposed inputs, three input dtypes
    from dion3_titan.kernels.backend import Backend

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for layout in ("rows", "transposed"):
            for extra in (0, 5):
                x = torch.randn(3, 24, 40) * 7.0
                x = (x if layout == "rows" else x.mT.contiguous().mT).to(dtype)
                got = ops.normalize(x, 1e-7, torch.float16, 24 + extra)
                want = Backend.normalize(ops, x, 1e-7, torch.float16, 24 + extra)
                results.append(
                    {
                        "check": "normalize",
                        "case": f"{dtype},{layout},+{extra} rows",
                        "bitwise": bool(torch.equal(got, want)),
                        "strides": got.stride() == want.stride(),
                        "zeros": bool((got[:, 24:] == 0).all()),
                    }
                )

    # float32 products are not tensor-core work: they go to torch at full precision
    a = torch.randn(2, 20, 12)
    results.append(
        {
            "check": "fp32_fallback",
            "case": "fp32",
            "ok": bool(torch.equal(ops.sym_mm(a, a.mT), TorchOps().sym_mm(a, a.mT))),
        }
    )
    return results


def _flag_checks(triton_mm) -> list[dict]:
    """``mm_tma``'s flags: set for exactly the matrices whose rounded result holds a NaN or inf
    (a NaN in C, a product that overflows the dtype, an inf in A), never cleared, and the
    result the same bits as without the check."""
    import torch

    out = []
    L, M, K, N = 4, 32, 48, 64
    huge = {torch.float16: 4e4, torch.bfloat16: 3e38}
    for cfg in [(16, 32, 16, 2, 4, 2), (16, 32, 16, 2, 4, 2, True, True)]:
        for dtype in (torch.float16, torch.bfloat16):
            a, b, c = (torch.randn(*s).to(dtype) for s in [(L, M, K), (L, K, N), (L, M, N)])
            b[:, :, :7] = b[:, :, :7].abs() + 1  # room for a product that overflows
            poisoned = {"nan_in_c": 1, "inf_in_a": 2, "overflow": 3}
            c[1, 5, 40] = float("nan")
            a[2, 17, 3] = float("inf")
            a[3, 30, :] = huge[dtype]  # finite in float32, beyond the dtype once rounded
            for name, with_c in (("with_c", True), ("without_c", False)):
                args = (a, b, c if with_c else None, 1.0, 0.5 if with_c else 0.0)
                flags = torch.zeros(L, dtype=torch.int32)
                flags[0] = 7 if name == "with_c" else 0  # a flag already set stays set
                got = triton_mm.mm_tma(*args, config=cfg, flags=flags)
                plain = triton_mm.mm_tma(*args, config=cfg)
                want = (~torch.isfinite(plain).flatten(1).all(1)).int()
                if name == "with_c":
                    want[0] = 7
                out.append(
                    {
                        "check": "mm_flags",
                        "case": f"{dtype},{name},{cfg}",
                        "flags": flags.tolist(),
                        "want": want.tolist(),
                        "poisoned_flagged": all(want[i] == 1 for k, i in poisoned.items() if with_c or k != "nan_in_c"),
                        "same_bits": got is not None and torch.equal(got.nan_to_num(), plain.nan_to_num()),
                    }
                )
    return out


def _result_check_checks(triton_ops, settings) -> list[dict]:
    """``ResultCheck`` through the Triton backend with its TMA GEMM switched on for the last
    product: standard and Gram NS (wide, and tall with its result in rows' order) flag exactly
    the matrices whose result is not finite, and give the bits of the unchecked call."""
    import dataclasses

    import torch

    from dion3_titan.kernels import triton_mm
    from dion3_titan.optim.nonfinite import nonfinite_matrices
    from dion3_titan.optim.orthogonalize import ResultCheck, orthogonalize

    small = triton_mm.Config(16, 32, 16, 2, 4, 2)
    saved = triton_mm.MM_CONFIG, triton_mm.MM_ADD_CONFIG, triton_mm.MM_ADD_MIN_TILES_PER_SM
    triton_mm.MM_CONFIG, triton_mm.MM_ADD_CONFIG, triton_mm.MM_ADD_MIN_TILES_PER_SM = small, small, 0
    out = []
    try:
        ops = triton_ops.TritonOps()
        for algorithm, shape in (("standard", (3, 32, 64)), ("gram", (3, 32, 96)), ("gram", (3, 96, 32))):
            ns = dataclasses.replace(settings, algorithm=algorithm)
            x = torch.randn(*shape)
            x[1, 3, 5] = float("nan")  # the whole matrix's NS result is NaN
            check = ResultCheck()
            got = orthogonalize(x, ns, ops, check=check)
            plain = orthogonalize(x, ns, ops)
            out.append(
                {
                    "check": "result_check",
                    "case": f"{algorithm},{shape}",
                    "bad": None if check.bad is None else check.bad.tolist(),
                    "want": nonfinite_matrices(plain).tolist(),
                    "same_bits": torch.equal(got.nan_to_num(), plain.nan_to_num()) and got.stride() == plain.stride(),
                }
            )
    finally:
        triton_mm.MM_CONFIG, triton_mm.MM_ADD_CONFIG, triton_mm.MM_ADD_MIN_TILES_PER_SM = saved
    return out


# ---------------------------------------------------------------- pytest side (parent process)
@pytest.fixture(scope="module")
def results(module_seed: int) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, __file__, str(module_seed)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _of(results: list[dict], check: str) -> list[dict]:
    found = [r for r in results if r["check"] == check]
    assert found, f"no {check} results"
    return found


def test_tile_schedule_covers_lower_triangle_once(results: list[dict]) -> None:
    bad = [r["case"] for r in _of(results, "tiles") if not r["ok"]]
    assert not bad


def test_sym_gemm_accuracy(results: list[dict]) -> None:
    # within twice the error of torch's own same-dtype product (plus float32 noise)
    bad = [r for r in _of(results, "sym_gemm") if not r["err"] <= 2 * r["torch_err"] + 1e-6]
    assert not bad, bad


def test_sym_gemm_writes_every_element(results: list[dict]) -> None:
    bad = [r["case"] for r in _of(results, "sym_gemm") if not r["finite"]]
    assert not bad


def test_sym_gemm_exactly_symmetric_in_input_dtype(results: list[dict]) -> None:
    bad = [r["case"] for r in _of(results, "sym_gemm") if not (r["symmetric"] and r["dtype_ok"])]
    assert not bad


def test_tma_kernel_declines_ragged_shapes(results: list[dict]) -> None:
    assert all(r["ok"] for r in _of(results, "tma_declines"))


def test_persistent_kernels_on_fewer_programs(results: list[dict]) -> None:
    bad = [r["case"] for r in _of(results, "leave_sms") if not r["ok"]]
    assert len(_of(results, "leave_sms")) == 4 and not bad, bad


def test_tma_kernel_allocates_the_same_result(results: list[dict]) -> None:
    bad = [r["case"] for r in _of(results, "tma_alloc") if not r["ok"]]
    assert not bad


def test_mm_tma_accuracy_and_coverage(results: list[dict]) -> None:
    """Within twice the error of torch's own same-dtype product, every element written."""
    bad = [
        r for r in _of(results, "mm_tma") if not (r["ran"] and r["finite"] and r["err"] <= 2 * r["torch_err"] + 1e-6)
    ]
    assert not bad, bad
    assert all(r["ok"] for r in _of(results, "mm_declines"))


def test_mm_tma_flags_the_nonfinite_matrices(results: list[dict]) -> None:
    found = _of(results, "mm_flags")
    assert len(found) == 8
    bad = [r for r in found if not (r["flags"] == r["want"] and r["poisoned_flagged"] and r["same_bits"])]
    assert not bad, bad


def test_newton_schulz_last_product_flags_its_result(results: list[dict]) -> None:
    found = _of(results, "result_check")
    assert len(found) == 3
    bad = [r for r in found if not (r["bad"] == r["want"] == [False, True, False] and r["same_bits"])]
    assert not bad, bad


def test_fused_update_matches_reference_bitwise(results: list[dict]) -> None:
    # float32 must be bit-identical; the interpreter's bf16 rounding is exact too, so bf16 is held
    # to the same standard here (the GPU test allows 1 ulp)
    bad = [r["case"] for r in _of(results, "fused_update") if not (r["bitwise"] and r["view_only"])]
    assert not bad


def test_gram_ns_on_triton_matches_torch(results: list[dict]) -> None:
    """Every symmetric product of Gram NS ran in Triton (5 iterations restarting after the
    second: 2 Gram matrices and 14 products), and the result is as accurate as the torch
    backend's in the same dtype.

    The bounds leave room for fp16 rounding noise on these tiny shapes and nothing more: over
    845 drawn inputs the Triton result's error against float64 was at most 1.35x the torch
    backend's (0.004-0.014 both), and the two fp16 results differed by at most 0.0083; the
    earlier bounds (1.25x, 0.01) failed on some draws. A kernel bug (a wrong tile, a lost
    mirror, a product rounded early) costs far more than 1.5x."""
    found = _of(results, "gram_ns")
    assert [r["case"].split(",")[0] for r in found] == list(GRAM_NS_CASES)
    for r in found:
        assert r["shape_ok"] and r["triton_products"] == r["products"] == 16, r
        assert r["err"] <= 1.5 * r["torch_err"] + 1e-3 and r["vs_torch"] < 2e-2, r


def test_normalize_matches_the_reference_bitwise(results: list[dict]) -> None:
    found = _of(results, "normalize")
    assert len(found) == 12
    bad = [r for r in found if not (r["bitwise"] and r["strides"] and r["zeros"])]
    assert not bad, bad


def test_float32_goes_to_torch(results: list[dict]) -> None:
    assert all(r["ok"] for r in _of(results, "fp32_fallback"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_torch_backend_exactly_symmetric(dtype: torch.dtype, seed: int) -> None:
    """The reference backend's symmetric products are symmetric bit for bit (its library
    product alone need not be), and equal the plain product's lower triangle."""
    from dion3_titan.kernels.torch_ops import TorchOps

    ops = TorchOps()
    for L, n, k in [(3, 64, 32), (1, 130, 64), (2, 37, 300)]:
        x = torch.randn(L, n, k).to(dtype)
        c = torch.randn(L, n, n)
        c = ((c + c.mT) / 2).to(dtype)
        for out, plain in [
            (ops.sym_mm(x, x.mT), torch.bmm(x, x.mT)),
            (ops.sym_addmm(x, x.mT, c, 0.7, -1.3), torch.baddbmm(c, x, x.mT, alpha=0.7, beta=-1.3)),
        ]:
            assert torch.equal(out, out.mT), (L, n, k)
            assert torch.equal(out.tril(), plain.tril()), (L, n, k)


def test_sym_dispatch_counts_k_steps() -> None:
    """The persistent symmetric kernel is taken by k-steps per SM, not tiles alone: the same
    576 tiles of 16 x 1024^2 take it at k = 4096 and not at k = 1024 (docs/benchmarks.md,
    "Symmetric GEMM dispatch")."""
    from dion3_titan.kernels.triton_ops import tma_pays

    assert tma_pays(16, 1024, 4096, 132) and not tma_pays(16, 1024, 1024, 132)
    assert tma_pays(32, 2048, 2048, 132) and tma_pays(16, 2816, 2816, 132)
    assert not tma_pays(4, 2048, 2048, 132) and not tma_pays(1, 256, 256, 132)


def test_mm_add_rule_by_tiles_per_sm() -> None:
    """X <- a X + B X goes to the Triton GEMM only where its tiles fill the SMs (32 x 2048^2:
    31 tiles per SM of an H200), to cuBLAS below (16 x 1024^2: 3.9), and never when switched off."""
    from dion3_titan.kernels import triton_mm

    assert triton_mm.add_config(32, 2048, 2048, 132) == triton_mm.MM_ADD_CONFIG is not None
    assert triton_mm.add_config(16, 1024, 1024, 132) is None


def test_get_backend_names() -> None:
    from dion3_titan.kernels import get_backend

    assert get_backend("torch").name == "torch"
    assert get_backend("triton").name == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        get_backend("cuda")


def test_select_backend_and_algorithm_on_cpu() -> None:
    import torch

    from dion3_titan.kernels import resolve_algorithm, select_backend

    assert select_backend("auto", (4, 2048, 8192), torch.float16, "cpu").name == "torch"
    assert select_backend("triton", (4, 2048, 8192), torch.float16, "cpu").name == "triton"
    with pytest.raises(ValueError, match="preference must be one of"):
        select_backend("fastest", (4, 2048, 8192), torch.float16, "cpu")
    assert resolve_algorithm("auto", 4096, 4096) == "standard"
    assert resolve_algorithm("auto", 4096, 11008) == "gram"


def test_cute_window_counts_the_padded_gram_side() -> None:
    """The sides "auto" sends to CuteDSL on Hopper are those its products run at (2752 rows are
    padded to 2816): all from 1024 to below 2816, from there on the sides its pair tiles cover
    (multiples of 256); others stay on Triton."""
    from dion3_titan.kernels import dispatch
    from dion3_titan.kernels.triton_ops import TritonOps

    pad = TritonOps().gram_side
    sides = (512, 1000, 1024, 1536, 2048, 2752, 2816, 3072, 4096, 4224, 8192)
    assert {n: dispatch.prefers_cute(pad(n)) for n in sides} == {
        512: False,
        1000: True,  # padded to 1024
        1024: True,
        1536: True,
        2048: True,
        2752: True,  # padded to 2816: pair tiles
        2816: True,
        3072: True,
        4096: True,
        4224: False,  # a multiple of 128, not of 256
        8192: True,
    }


def test_auto_choice_on_a_gpu_with_and_without_cutedsl() -> None:
    """What "auto" runs for an fp16/bf16 batch on a CUDA GPU, by Gram side: torch's products
    below TRITON_MIN_N, then CuteDSL's on the sides of its window where it runs, Triton's on the
    rest, and Triton's everywhere from TRITON_MIN_N on where CuteDSL does not run."""
    from dion3_titan.kernels import dispatch

    sides = (128, 255, 256, 512, 1000, 2752, 4224, 8192)
    assert {n: dispatch.auto_choice(n, cute_runs=True) for n in sides} == {
        128: "torch",
        255: "torch",
        256: "triton",
        512: "triton",
        1000: "cute",
        2752: "cute",
        4224: "triton",
        8192: "cute",
    }
    assert {n: dispatch.auto_choice(n, cute_runs=False) for n in sides} == {
        n: "torch" if n < dispatch.TRITON_MIN_N else "triton" for n in sides
    }


def test_cute_general_table_covers_every_tile_once() -> None:
    """The general mode's tile list: every (row, column) tile exactly once, in bands of GROUP
    rows taken column by column."""
    from dion3_titan.kernels import cute_symm

    for rows, cols, group in [(1, 1, 8), (3, 5, 2), (16, 8, 8), (11, 16, 8), (20, 3, 8)]:
        table = cute_symm._rect_table(rows, cols, group, torch.device("cpu"))
        got = [tuple(t) for t in table.T.tolist()]
        assert sorted(got) == [(r, c) for r in range(rows) for c in range(cols)]
        assert got[: min(group, rows)] == [(r, 0) for r in range(min(group, rows))]


def test_cute_module_imports_without_a_gpu() -> None:
    import torch

    from dion3_titan.kernels import cute_symm

    if not cute_symm.is_available():
        with pytest.raises(RuntimeError, match="backend='cute' needs"):
            cute_symm.CuteOps()
    # outside the kernel's limits sym_gemm declines (the backend then falls back to Triton)
    x = torch.randn(1, 100, 64, dtype=torch.float16)
    assert cute_symm.sym_gemm(x, x.mT) is None


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the pytest tests do)")
    from tests.interpret import patch_language_once

    patch_language_once()
    for result in _run_checks(int(sys.argv[1])):
        print(json.dumps(result))


def test_wide_tma_config_needs_even_group() -> None:
    from dion3_titan.kernels import triton_ops

    x = torch.randn(1, 32, 16).half()
    with pytest.raises(ValueError, match="even GROUP"):
        triton_ops.sym_gemm_tma(x, x.mT, config=(16, 16, 3, 4, 2, False, True))


def test_scratch_allocator_leaves_a_programs_own() -> None:
    """The persistent kernels need an allocator for their device-side descriptors: ours is set
    only where the program has none, never over the program's own."""
    import triton
    from triton.runtime import _allocation

    from dion3_titan.kernels import tma

    saved = _allocation._allocator.get()
    try:
        triton.set_allocator(_allocation.NullAllocator())
        tma.ensure_scratch_allocator()
        assert _allocation._allocator.get() is tma.torch_scratch

        def own(size: int, alignment: int, stream):
            return torch.empty(size, dtype=torch.int8)

        triton.set_allocator(own)
        tma.ensure_scratch_allocator()
        assert _allocation._allocator.get() is own
    finally:
        triton.set_allocator(saved)


def test_cute_operand_orders_are_read_from_strides() -> None:
    """The CuteDSL wrappers read each operand's memory order (a's, and b^T's without making b^T)
    and whether both sides are one matrix from shapes and strides: the answers of the views
    themselves, for row- and column-major operands, padded rows and batches, column slices,
    misaligned strides, size-1 modes and fp32."""
    from dion3_titan.kernels import cute_symm

    def major(x: torch.Tensor) -> str | None:  # of a (L, rows, k) view
        size = x.element_size()
        if x.stride(2) == 1 and x.stride(1) * size % 16 == 0:
            return "k"
        if x.stride(1) == 1 and x.stride(2) * size % 16 == 0:
            return "n"
        return None

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()

    def layouts(L: int, r: int, c: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [
            torch.zeros(L, r, c, dtype=dtype),  # row-major
            torch.zeros(L, c, r, dtype=dtype).mT,  # column-major
            torch.zeros(L + 1, r + 8, c + 8, dtype=dtype)[:L, :r, :c],  # rows and batches padded
            torch.zeros(L + 1, c + 8, r + 8, dtype=dtype)[:L, :c, :r].mT,
            torch.zeros(L, r, c + 3, dtype=dtype)[:, :, :c],  # rows 3 elements apart: no 16-byte stride
            torch.zeros(L, c, r, dtype=dtype).permute(0, 2, 1).contiguous(),
        ]

    cases = 0
    for dtype, (L, n, k) in itertools.product((torch.float16, torch.float32), ((2, 16, 24), (1, 8, 8), (3, 1, 16))):
        for a in layouts(L, n, k, dtype):
            partners = [*layouts(L, k, n, dtype), a.mT]
            if n == k:
                partners.append(a)
            for b in partners:
                majors = (major(a), major(b.mT))
                expect = None if None in majors or dtype == torch.float32 or k % 8 else majors
                assert cute_symm._majors(a, b, ()) == expect, (dtype, a.stride(), b.stride())
                one = same(a, b.mT) or (n == k and same(a, b))
                assert cute_symm._same_operand(a, b) == one, (a.shape, a.stride(), b.shape, b.stride())
                cases += 1
    assert cases == 264


def test_cute_wrappers_hand_the_kernel_its_operands_form_and_tiles(monkeypatch) -> None:
    """sym_gemm and gemm on CPU tensors with the compiled kernel, the SM count and the triangle
    table stood in (no GPU here): which kernel form each asks for (pair, mirror, general), the
    tile table and CTA count it launches with, the tensors a, b, C and the result it passes (as
    they are: the kernel takes torch's mode order), and None outside the kernel's limits."""
    from dion3_titan.kernels import cute_symm

    launches: list[tuple] = []

    def compiled(*key):
        return lambda *args: launches.append((key, args))

    monkeypatch.setattr(cute_symm, "_compiled", compiled)
    monkeypatch.setattr(cute_symm, "grid_sms", lambda device: 132)
    monkeypatch.setattr(
        cute_symm, "_tile_table", lambda side, group, device: torch.zeros(2, side * (side + 1) // 2, dtype=torch.int32)
    )

    def view(t: torch.Tensor) -> tuple:  # a tensor as the kernel takes it: torch's (L, rows, cols), no copy
        return t.data_ptr(), tuple(t.shape), tuple(t.stride())

    def launched(args: tuple) -> tuple:  # the kernel's arguments, its tensors described
        return tuple(
            (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if isinstance(t, torch.Tensor) and t.dtype != torch.int32
            else t
            for t in args
        )

    x = torch.randn(2, 2048, 256, dtype=torch.float16)
    y = x.clone()
    c = torch.randn(2, 2048, 2048, dtype=torch.float16)
    for b, mirror in ((x.mT, False), (y.mT, True)):  # the same operand needs no mirror
        launches.clear()
        out = cute_symm.sym_gemm(x, b, c, 0.5, -1.5)
        ((key, args),) = launches
        assert key[:5] == ("Float16", "k", "k", True, cute_symm.PAIR_STAGES)
        # a pair's diagonal halved; no rows named zero, no skipping path
        assert key[5:] == (True, mirror, False, False, cute_symm.HALF_DIAGONAL, False)
        a_v, b_v, c_v, out_v, table, _, ctas, bound, alpha, beta = launched(args)
        assert (a_v, b_v, c_v, out_v) == (view(x), view(b), view(c), view(out))
        assert table.shape == (2, 36) and ctas == 2 * min(66, 2 * 36) and (alpha, beta) == (0.5, -1.5)
        assert bound == 2048  # past every row
    launches.clear()
    small = torch.randn(3, 1024, 64, dtype=torch.bfloat16)
    out = cute_symm.sym_gemm(small, small.mT)  # 128 x 128 tiles below PAIR_MIN_N, no C
    ((key, args),) = launches
    assert key == ("BFloat16", "k", "k", False, cute_symm.STAGES, False, False, False, False, False, False)
    assert launched(args)[2] == view(out) and launched(args)[6] == min(132, 3 * 36)

    # rows named zero (zero_from): the skipping kernel where some warpgroup's 64 rows all lie
    # there, given the bound; the kernel without it where none does (a bound inside the last 64
    # rows); the skipping kernel given a bound past every row under SKIP_NEVER; never in SKIP_ZERO_ROWS off
    for zero_from, switches, skip, bound in (
        (1984, {}, True, 1984),
        (1930, {}, True, 1930),
        (1990, {}, False, 2048),
        (1984, {"SKIP_NEVER": True}, True, 2048),
        (1984, {"SKIP_ZERO_ROWS": False}, False, 2048),
    ):
        with monkeypatch.context() as m:
            for name, value in switches.items():
                m.setattr(cute_symm, name, value)
            launches.clear()
            cute_symm.sym_gemm(x, x.mT, c, 0.5, -1.5, zero_from=zero_from)
            ((key, args),) = launches
            assert key[-1] == skip and launched(args)[7] == bound, (zero_from, switches, key, launched(args)[7])

    a = torch.randn(2, 2048, 512, dtype=torch.float16)
    cases = ((torch.randn(2, 512, 4096, dtype=torch.float16), 4096), (torch.randn(2, 640, 512).half().mT, 640))
    for (b, m), check in itertools.product(cases, (False, True)):
        cc = torch.randn(2, 2048, m, dtype=torch.float16).mT.contiguous().mT  # column-major C: made row-major
        launches.clear()
        flags = torch.zeros(2, dtype=torch.int32) if check else None
        out = cute_symm.gemm(a, b, cc, 1.0, 1.875, flags=flags)
        ((key, args),) = launches
        pair = m % 256 == 0
        b_major = "n" if b.stride(2) == 1 else "k"  # of b^T
        assert key == (
            "Float16",
            "k",
            b_major,
            True,
            cute_symm.PAIR_STAGES if pair else cute_symm.STAGES,
            pair,
            False,
            True,
            check,
            False,  # every tile of a general product is whole
            False,  # and multiplied
        )
        a_v, b_v, c_v, out_v, table, flags_v, ctas, _, alpha, beta = launched(args)
        assert flags_v is flags if check else flags_v.shape == (1,)  # unchecked: never written
        assert (a_v, b_v, out_v) == (view(a), view(b), view(out)) and out.shape == (2, 2048, m)
        assert c_v[1:] == view(cc.contiguous())[1:]
        cm = 2 if pair else 1
        assert torch.equal(table, cute_symm._rect_table(2048 // (128 * cm), m // (128 * cm), cute_symm.GROUP, a.device))
        assert ctas == cm * min(132 // cm, 2 * table.shape[1]) and (alpha, beta) == (1.0, 1.875)
    launches.clear()
    assert cute_symm.gemm(a.float(), torch.randn(2, 512, 256)) is None  # fp32
    assert cute_symm.gemm(a, torch.randn(2, 512, 200, dtype=torch.float16)) is None  # m off the tile grid
    assert cute_symm.sym_gemm(torch.randn(2, 2048, 12, dtype=torch.float16), torch.randn(2, 12, 2048).half()) is None
    assert cute_symm.gemm(a[:0], torch.randn(0, 512, 256, dtype=torch.float16)) is None  # empty batch
    b = torch.randn(2, 512, 256, dtype=torch.float16)
    assert cute_symm.gemm(a, b, flags=torch.zeros(3, dtype=torch.int32)) is None  # a flag per matrix
    assert cute_symm.gemm(a, b, flags=torch.zeros(2)) is None  # int32 flags
    assert not launches
