"""Shared test setup: tests marked ``gpu`` are skipped on machines without CUDA."""

import pytest
import torch


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
