"""Shared test setup.

- One CPU thread per test process (below).
- Tests marked ``gpu`` are skipped on machines without CUDA.
- Cached kernel launches are verified against the JIT (``DION3_VERIFY_LAUNCHES``, below).
- Random inputs: a test that draws fresh random inputs takes the ``seed`` fixture. One seed is
  drawn per session (from ``DION3_TEST_SEED`` when set, else from the OS), shown in the report
  header and on every failure of a test that used it, so a failing draw can be replayed.
"""

import os

import pytest
import torch

SEED_ENV = "DION3_TEST_SEED"


def _session_seed() -> int:
    given = os.environ.get(SEED_ENV)
    if given:
        try:
            return int(given)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={given!r}: must be an integer") from None
    return int.from_bytes(os.urandom(4), "little")


# Test processes share the machine's cores (pytest-xdist's workers, the spawned ranks, the tests'
# child processes): one thread each unless OMP_NUM_THREADS says otherwise. Tiny tensor ops run
# many times slower with threads of several processes contending for the same cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Every launch that takes kernels/launch.py's cache is checked against the JIT's own choice of
# compiled kernel (in this process and the ranks and trainers it spawns).
os.environ.setdefault("DION3_VERIFY_LAUNCHES", "1")

SESSION_SEED = _session_seed()
# pytest-xdist's workers and the tests' own subprocesses inherit it: one seed for the session
os.environ[SEED_ENV] = str(SESSION_SEED)


def pytest_report_header(config: pytest.Config) -> str:
    return f"random test inputs: seed {SESSION_SEED} (replay with {SEED_ENV}={SESSION_SEED})"


@pytest.fixture
def seed() -> int:
    """The session's seed; torch's global generators are seeded with it too."""
    torch.manual_seed(SESSION_SEED)
    return SESSION_SEED


@pytest.fixture(scope="module")
def module_seed() -> int:
    """The session's seed for module-scoped fixtures (computed once per module)."""
    return SESSION_SEED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and {"seed", "module_seed"} & set(getattr(item, "fixturenames", ())):
        report.sections.append(
            ("random inputs", f"drawn from seed {SESSION_SEED}; replay with {SEED_ENV}={SESSION_SEED}")
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
