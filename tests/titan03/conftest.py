"""tests/titan03 runs only with torchtitan 0.3 installed (scripts/test_titan03.sh); the main suite
(torchtitan 0.2.2) skips it."""

from importlib.metadata import version


def pytest_ignore_collect(collection_path, config):
    major, minor = (int(x) for x in version("torchtitan").split(".")[:2])
    return (major, minor) < (0, 3) or None
