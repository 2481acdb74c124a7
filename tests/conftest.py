"""Shared fixtures: a family of small random Llama models saved to disk once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def family(tmp_path_factory) -> dict:
    """target (8 layers), mid (its first 4), tiny (its first 1), other (independent): paths."""
    from tests.fixtures.toy_models import build_family

    return {name: str(path) for name, path in build_family(tmp_path_factory.mktemp("toy")).items()}


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
