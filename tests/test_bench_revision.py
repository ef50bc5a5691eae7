"""The benchmarks' A/B of another revision's CuteDSL kernels in one process
(``--cute-baseline``): the file loads as a module of its own, and bench_orthogonalize's variant
puts its kernels in the names the backend calls, then restores ours. CPU only: the kernels are
loaded, not run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _revision_file(tmp_path: Path, marker: str) -> Path:
    """This tree's cute_symm.py with a marker appended: a stand-in for another revision's."""
    source = (ROOT / "dion3_titan" / "kernels" / "cute_symm.py").read_text()
    path = tmp_path / "base_cute_symm.py"
    path.write_text(source + f"\nMARKER = {marker!r}\n")
    return path


def test_load_revision_gives_a_module_of_its_own(tmp_path):
    from benchmarks.revision import load_revision
    from dion3_titan.kernels import cute_symm

    base = load_revision(str(_revision_file(tmp_path, "base")), "baseline_cute_symm_test")
    assert base.MARKER == "base" and not hasattr(cute_symm, "MARKER")
    assert base.gemm is not cute_symm.gemm and base.sym_gemm is not cute_symm.sym_gemm
    assert base.__name__ == "baseline_cute_symm_test"


def test_baseline_variant_switches_the_kernels_the_backend_calls_and_restores_them(tmp_path):
    from benchmarks import orthogonalize as bench
    from dion3_titan.kernels import cute_symm

    ours = (cute_symm.gemm, cute_symm.sym_gemm)
    changes = bench.baseline_switches(str(_revision_file(tmp_path, "base")))
    with bench.switched(changes):
        assert cute_symm.gemm.__module__ == cute_symm.sym_gemm.__module__ == "baseline_cute_symm"
        assert cute_symm.gemm.__globals__["MARKER"] == "base"
        # the backend's methods look both names up in the module at each call
        names = cute_symm.CuteOps.mm_add.__globals__
        assert (names["gemm"], names["sym_gemm"]) == (cute_symm.gemm, cute_symm.sym_gemm) != ours
    assert (cute_symm.gemm, cute_symm.sym_gemm) == ours


def test_the_benchmarks_take_the_baseline_option():
    for script in ("benchmarks/orthogonalize.py", "benchmarks/sym_ab.py"):
        assert '"--cute-baseline"' in (ROOT / script).read_text(), script
