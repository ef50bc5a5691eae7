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


def test_a_module_and_its_kernel_load_from_the_same_revision(tmp_path):
    """A host module's import of its kernel module resolves to the kernel file beside it (the
    same revision's), and the current tree's kernel module is back in place afterwards."""
    import sys

    from benchmarks.revision import load_revision
    from dion3_titan.kernels import cute_symm, cute_symm_sm90

    folder = tmp_path / "base"
    folder.mkdir()
    for stem, marker in (("cute_symm", "host"), ("cute_symm_sm90", "kernel")):
        source = (ROOT / "dion3_titan" / "kernels" / f"{stem}.py").read_text()
        (folder / f"{stem}.py").write_text(source + f"\nMARKER = {marker!r}\n")
    base = load_revision(str(folder / "cute_symm.py"), "baseline_pair_test")
    assert base.MARKER == "host"
    assert base.kernel_class.__wrapped__.__globals__["MARKER"] == "kernel"
    assert base.kernel_class is not cute_symm_sm90.kernel_class
    assert sys.modules["dion3_titan.kernels.cute_symm_sm90"] is cute_symm_sm90
    assert cute_symm.kernel_class is cute_symm_sm90.kernel_class and not hasattr(cute_symm_sm90, "MARKER")


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
