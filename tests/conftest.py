"""Shared pytest set-up: GPU marker handling and cleanup of the distributed rank pools."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import close_all_pools


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    close_all_pools()
