"""Shared test setup: GPU-only tests are skipped (with the reason) where CUDA is absent."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
