"""Extract English documents from the Python installation running this code.

Sources (both present on every CPython install, so no network is needed):
  * `pydoc_data.topics`: the language-reference text that `help()` shows (~0.5 MB);
  * docstrings of the standard library's modules (one document per source file).
The order is fixed (sorted relative paths, sorted topic names) and the train/validation split
is a hash of each document's id, so the same Python build always yields the same corpus.
"""

import ast
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

# Folders whose docstrings are test fixtures, vendored third-party code or generated tables
# rather than prose; leaving them out keeps the corpus English documentation.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "lib2to3", "encodings", "__pycache__"})
_MIN_DOC_CHARS = 200  # shorter files add mostly one-line "Return x." docstrings


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable name: "topic:<name>" or "stdlib:<relative path>"
    text: str


def _topics() -> Iterator[Document]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if len(text) >= _MIN_DOC_CHARS:
            yield Document(f"topic:{name}", text)


def _file_docstrings(path: str) -> str:
    """All docstrings of one source file (module, classes, functions) in source order."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, nodes)]
    return "\n\n".join(d.strip() for d in docs if d and d.strip())


def _stdlib_files(packages: bool) -> list[str]:
    """Relative paths of stdlib .py files; top-level modules only unless `packages`."""
    root = sysconfig.get_paths()["stdlib"]
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and packages)
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return sorted(out)


def _stdlib(packages: bool) -> Iterator[Document]:
    root = sysconfig.get_paths()["stdlib"]
    for rel in _stdlib_files(packages):
        text = _file_docstrings(os.path.join(root, rel))
        if len(text) >= _MIN_DOC_CHARS:
            yield Document(f"stdlib:{rel.replace(os.sep, '/')}", text)


# Installed packages whose docstrings extend the large corpus. torch is a hard dependency of
# this project and sympy/networkx/mpmath are torch's; numpy and pandas come with `datasets`.
# Packages that are missing are skipped and listed in the build's meta.json.
LARGE_PACKAGES = ("torch", "sympy", "mpmath", "networkx", "numpy", "pandas")


def _package_files(root: str) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(out)


def _packages(names: tuple[str, ...]) -> Iterator[Document]:
    import importlib.util

    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = list(spec.submodule_search_locations)[0]
        for path in _package_files(root):
            text = _file_docstrings(path)
            if len(text) >= _MIN_DOC_CHARS:
                rel = os.path.relpath(path, os.path.dirname(root)).replace(os.sep, "/")
                yield Document(f"pkg:{rel}", text)


def documents(size: str) -> list[Document]:
    """'small': topics + top-level stdlib modules (~1.4 MB of text, ~0.4M tokens);
    'large': every stdlib package plus LARGE_PACKAGES' docstrings (~20 MB, >5M tokens)."""
    if size == "small":
        return [*_topics(), *_stdlib(packages=False)]
    if size == "large":
        return [*_topics(), *_stdlib(packages=True), *_packages(LARGE_PACKAGES)]
    raise ValueError(f"size must be 'small' or 'large', got {size!r}")


def package_versions() -> dict[str, str]:
    """Versions of the extra sources, recorded so a corpus can be traced to its inputs."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for name in LARGE_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def is_validation(doc: Document, val_percent: float) -> bool:
    """Deterministic held-out split: a document goes to validation by the hash of its id."""
    h = int.from_bytes(hashlib.sha256(doc.doc_id.encode()).digest()[:8], "big")
    return (h % 10_000) < val_percent * 100
