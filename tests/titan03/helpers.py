"""Launch real torchtitan 0.3 training (torchrun, gloo on CPU) for the titan03 tests."""

from pathlib import Path

from tests.titan_helpers import REPO, TitanRun, ensure_corpus, logged_losses, torchrun_inspected  # noqa: F401


def run_titan03(config: str, dump_folder: Path, *overrides: str, nproc: int = 2, timeout: float = 600) -> TitanRun:
    """torchrun `nproc` ranks of `dion3_titan.train` with config function `config` of
    tests/titan03/inspect_recipes.py and command-line `overrides`."""
    target = [
        "-m",
        "dion3_titan.train",
        "--module",
        "tests.titan03.inspect_recipes",
        "--config",
        config,
        "--dump_folder",
        str(dump_folder),
    ]
    return torchrun_inspected([*target, *overrides], dump_folder, nproc, timeout)
