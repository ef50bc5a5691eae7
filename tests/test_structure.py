"""The package's layering, read from its import statements (module level and inside functions):

- the core (``optim/``, ``dist/``, ``kernels/``) imports nothing above it (no adapter, no shared
  torchtitan glue) and never torchtitan;
- no module reaches another through a chain that comes back to it (no circle anywhere);
- the two torchtitan adapters are sibling folders with the same file names for the same roles;
- the step's stage methods stay short.
"""

import ast
from pathlib import Path

import dion3_titan

PACKAGE = Path(dion3_titan.__file__).parent
CORE = ("optim", "dist", "kernels")


def _module_name(path: Path) -> str:
    parts = ["dion3_titan", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(package modules imported, top-level outside packages imported) by ``path``."""
    inside, outside = set(), set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" imports mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            if name.split(".")[0] == "dion3_titan":
                while name not in modules:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                inside.add(name)
            else:
                outside.add(name.split(".")[0])
    return inside, outside


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    edges, external = {}, {}
    for name, path in modules.items():
        edges[name], external[name] = _imports(path, modules)
        edges[name].discard(name)
    return edges, external


def _is_core(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] in CORE


def test_core_imports_only_core_and_never_torchtitan():
    edges, external = _graph()
    core = [m for m in edges if _is_core(m)]
    assert len(core) > 20, core  # the walk found the package
    upward = {m: sorted(d for d in edges[m] if not _is_core(d)) for m in core}
    assert not any(upward.values()), {m: d for m, d in upward.items() if d}
    titan = sorted(m for m in core if "torchtitan" in external[m])
    assert not titan, titan


def test_no_import_cycle():
    edges, _ = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d) :] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_adapters_are_parallel():
    """Each generation's adapter holds its container, CPU shims, metrics and train entry under
    the same file names."""
    roles = {"optimizers.py", "cpu_shims.py", "metrics.py", "train.py", "__init__.py"}
    for adapter in ("titan02", "titan03"):
        files = {p.name for p in (PACKAGE / adapter).glob("*.py")}
        assert roles <= files, (adapter, sorted(roles - files))
    top = {p.name for p in PACKAGE.glob("*.py")}
    # what both generations share, named for what it is; the 0.2 public TOML name stays
    assert top == {
        "__init__.py",
        "__main__.py",
        "names.py",
        "optimizer_metrics.py",
        "cpu_shims.py",
        "train.py",
        "compressed.py",
        "clipping.py",
        "job_config.py",
    }, sorted(top)


def test_the_step_reads_as_short_stages():
    """The step's stages stay small: no method of the pipeline (optim/dion3.py), of the stage
    interface or of its two implementations, or of the selection, is over 40 lines."""
    files = ["dion3.py", "stages.py", "stages_engine.py", "stages_reference.py", "selection.py"]
    long = []
    for name in files:
        tree = ast.parse((PACKAGE / "optim" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 40:
                long.append(f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
