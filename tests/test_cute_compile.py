"""The CuteDSL symmetric GEMM compiles, on a machine without a GPU, for every configuration
``cute_symm.sym_gemm`` can ask for, and its PTX has the structure the kernel is built on.

The kernel runs only on a Hopper GPU (tests/gpu checks its results there); compiling it needs
no GPU (CuteDSL targets ``CUTE_DSL_ARCH=sm_90a`` from fake tensors), so a change that breaks it
fails here, in CI, instead of on the next GPU run. The structure checked is what the kernel's
speed rests on (kernels/cute_symm.py's docstring): wgmma tensor-core products, TMA loads
into shared memory, an epilogue that writes each tile and its transpose through shared memory
(``stmatrix`` and ``stmatrix.trans``) and leaves by TMA stores only, never by per-thread global
stores (but the flag of the general mode's finiteness check), and the producer/consumer
register split. ptxas (the one Triton ships) then assembles each PTX for sm_90a, as the GPU's
driver would: no register spills, no serialized wgmma. CI installs CuteDSL (scripts/setup_env.sh
on a machine without a GPU); elsewhere the test skips when it is missing, and fails under CI=true.
"""

import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every (dtype, A's major, B^T's major, with C, pair form) that sym_gemm compiles for, with the
# diagonal mirror; without it for the operand layouts of the products that leave it out (X X^T:
# both k-major; A A: A k-major, A^T n-major), in fp16.
# A symmetric pair kernel halves its diagonal tiles' products (HALF_DIAGONAL, the default); one
# configuration keeps them whole (the benchmarks' A/B).
CONFIGS = [
    (*config, True, False, False, config[-1], False)
    for config in itertools.product(["Float16", "BFloat16"], ["k", "n"], ["k", "n"], [False, True], [False, True])
] + [
    ("Float16", "k", b, has_c, pair, False, general, False, pair and not general, False)
    for b in ("k", "n")
    for has_c in (False, True)
    for pair in (False, True)
    for general in (False, True)
]
CONFIGS += [("Float16", "k", "n", True, True, True, False, False, False, False)]
# With the path that skips the warpgroups of zero rows (``zero_from``), on the layouts of
# Newton-Schulz's symmetric products, which name their padding: X X^T, A A + C, Q Z + C.
CONFIGS += [
    (dtype, "k", b, has_c, pair, mirror, False, False, pair, True)
    for dtype, b, has_c, mirror in [
        ("Float16", "k", False, False),
        ("Float16", "n", True, False),
        ("Float16", "n", True, True),
        ("BFloat16", "n", True, True),
    ]
    for pair in (False, True)
]
# The general mode with the finiteness check in its epilogue (``gemm``'s flags), on the operands
# of Newton-Schulz's last product: X <- a X + B X (with C), Q X (A = Q), X^T Q of a tall batch
# (A = X^T, n-major after a restart).
CONFIGS += [
    (dtype, a, "n", has_c, pair, False, True, True, False, False)
    for dtype, a, has_c in [
        ("Float16", "k", True),
        ("Float16", "k", False),
        ("Float16", "n", False),
        ("BFloat16", "k", True),
    ]
    for pair in (False, True)
]

# Compiles each configuration in a fresh process (CuteDSL reads its environment at import) and
# prints, per configuration, how often each instruction of interest appears in the PTX (the
# patterns accept the spellings of CuteDSL 4.5 and 4.8, whose PTX names state spaces differently).
COMPILE_ALL = r"""
import json, re, sys
from dion3_titan.kernels import cute_symm
INSTRUCTIONS = {
    "wgmma": r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.(\w+)\.",
    "wgmma_wide": r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.(\w+)\.",
    "multicast": r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.\S*multicast::cluster",
    "tma_load": r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cluster|cta)\.global\.",
    "tma_store": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.",
    "stmatrix": r"stmatrix\.sync\.aligned\.m8n8\.x4\.(?:shared\.)?b16",
    "stmatrix_trans": r"stmatrix\.sync\.aligned\.m8n8\.x4\.trans\.(?:shared\.)?b16",
    "global_store": r"\bst\.global\.",
    "nan_max": r"max\.NaN\.f32",
    "setmaxnreg": r"setmaxnreg\.(?:inc|dec)\.",
    "scalar_shared_store": r"st\.shared(?:::cta)?\.(?:u16|b16)",
    "vector_shared_store": r"st\.shared(?:::cta)?\.v4\.b32",
}
found = {}
for dtype, a_major, b_major, has_c, pair, mirror, general, check, half, skip in json.loads(sys.argv[1]):
    stages = cute_symm.PAIR_STAGES if pair else cute_symm.STAGES
    ptx = cute_symm._compiled(dtype, a_major, b_major, has_c, stages, pair, mirror, general, check, half, skip).artifacts.PTX
    with open(f"{len(found)}.ptx", "w") as f:  # for ptxas, in the configurations' order
        f.write(ptx.rstrip("\x00"))
    counts = {name: len(re.findall(pattern, ptx)) for name, pattern in INSTRUCTIONS.items()}
    wgmma = INSTRUCTIONS["wgmma_wide" if pair else "wgmma"]
    counts["wgmma_types"] = sorted(set(re.findall(wgmma, ptx)))
    found[f"{dtype},{a_major},{b_major},{has_c},{pair},{mirror},{general},{check},{half},{skip}"] = counts
print("PTX " + json.dumps(found))
"""


def _ptxas() -> str | None:
    """The ptxas that Triton ships (the pinned one CI installs), else one on PATH."""
    try:
        import triton
    except ImportError:
        triton = None
    if triton is not None:
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if bundled.is_file():
            return str(bundled)
    return shutil.which("ptxas")


# Known to ptxas 12.9 (Triton 3.9's) with CuteDSL 4.5.2: the general mode's pair kernel spills
# 4 bytes (20 in bf16 with C and the check) with C or the check, and with C (X <- a X + B X of
# standard Newton-Schulz) serializes its wgmmas "due to program dependence on compiler-inserted
# WG.AR in divergent path" (docs/kernels.md: why, and a variant without it that measured no
# faster on a GPU). Four symmetric pair layouts with the halved diagonal serialize "due to
# insufficient register resources": layouts Newton-Schulz never asks for (its symmetric products
# with C or two operands take A k-major, B^T n-major). The fourth (both k-major, with C and the
# mirror) joined them when the kernel took one more argument (``zero_from``), unused there.
_HALF_SERIALIZED = {("k", "n", False, True), ("n", "k", True, False), ("n", "n", True, True), ("k", "k", True, True)}


def _may_serialize(dtype, a_major, b_major, has_c, pair, mirror, general, check, half, skip) -> bool:
    if pair and general and (has_c or check):
        return True
    return half and (a_major, b_major, has_c, mirror) in _HALF_SERIALIZED


def _cute_dsl_installed() -> bool:
    if importlib.util.find_spec("cutlass") is not None:
        return True
    if os.environ.get("CI") == "true":
        pytest.fail("nvidia-cutlass-dsl is not installed under CI: scripts/setup_env.sh installs it without a GPU")
    return False


@pytest.mark.slow
@pytest.mark.skipif(not _cute_dsl_installed(), reason="nvidia-cutlass-dsl not installed")
def test_every_configuration_compiles_for_sm90_with_the_kernels_structure(tmp_path):
    env = {
        **os.environ,
        "CUTE_DSL_ARCH": "sm_90a",  # compile for Hopper without one
        "CUTE_DSL_KEEP": "ptx",  # keep the PTX on the compiled function
        "CUTE_DSL_DUMP_DIR": str(tmp_path),  # where CuteDSL writes its copy of it
        "CUTE_DSL_NO_CACHE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_ALL, json.dumps(CONFIGS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"CuteDSL compile failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    line = next(x for x in run.stdout.splitlines() if x.startswith("PTX "))
    found = json.loads(line[4:])
    assert len(found) == len(CONFIGS)
    # ptxas assembles each configuration's PTX below, as the GPU's driver would
    ptxas = _ptxas()
    assert ptxas is not None or os.environ.get("CI") != "true", "no ptxas under CI (Triton ships one)"
    for index, (config, counts) in enumerate(found.items()):
        fields = [f == "True" if f in ("True", "False") else f for f in config.split(",")]
        dtype, a_major, b_major, has_c, pair, mirror, general, check, half, _ = fields
        expect_type = {"Float16": "f16", "BFloat16": "bf16"}[dtype]
        assert counts["wgmma_types"] == [expect_type], (config, counts)
        # the pair form: 64 x 256 products per warpgroup, B's panel loaded once for both CTAs
        shaped = ("wgmma_wide", "multicast") if pair else ("wgmma",)
        # the general mode (every tile, no transpose) stores each block as computed
        written = ("stmatrix",) if general else ("stmatrix", "stmatrix_trans")
        for name in (*shaped, "tma_load", "tma_store", *written, "setmaxnreg"):
            assert counts[name] > 0, f"{config}: no {name} in the PTX ({counts})"
        if general:
            assert counts["stmatrix_trans"] == 0, (config, counts)
        if not pair:
            assert counts["wgmma_wide"] == counts["multicast"] == 0, (config, counts)
        else:  # 64 x 128 products in a pair kernel: only a halved diagonal tile's first CTA
            assert (counts["wgmma"] > 0) == half, f"{config}: half_diagonal {half} ({counts})"
        # the tile leaves by TMA; a thread stores to global memory only to flag a non-finite
        # block (the check: a NaN-propagating max of the block's values), once per block
        assert counts["global_store"] == (2 if pair else 1) * check, f"{config}: per-thread global stores ({counts})"
        assert (counts["nan_max"] > 0) == check, f"{config}: the check's max ({counts})"
        # the diagonal mirror is the kernel's only thread-wise shared-memory store, 16 bytes wide
        assert counts["scalar_shared_store"] == 0, f"{config}: element-wise shared-memory stores ({counts})"
        assert (counts["vector_shared_store"] > 0) == mirror, f"{config}: mirror {mirror} ({counts})"

        # no register spills and no serialized wgmma (ptxas's warning where it cannot keep the
        # wgmmas in flight: the kernel would lose its overlap), but where known (``_may_serialize``)
        if ptxas is None:
            continue
        run = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(tmp_path / f"{index}.ptx"), "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=120,
        )
        report = run.stdout + run.stderr
        assert run.returncode == 0, f"{config}: ptxas failed:\n{report[-3000:]}"
        clean = "0 bytes spill stores, 0 bytes spill loads" in report and "serializ" not in report.lower()
        assert clean or _may_serialize(*fields), f"{config}: spills or serialized wgmma:\n{report[-3000:]}"
