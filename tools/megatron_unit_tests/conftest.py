"""A CPU stand-in for Megatron-LM's ``tests/unit_tests/conftest.py`` (written for megatron_core).

Same fixture names (``tmp_path_dist_ckpt``, ``experimental``); ``.cuda()`` on tensors and modules is the
identity and ``torch.cuda.synchronize``/``empty_cache``/``manual_seed`` are no-ops, so tests that only move
data to the GPU run on CPU. Each test gets a wall-clock limit (``MCORE_UNIT_TEST_TIMEOUT``, default 120 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import unittest.mock
from pathlib import Path

import pytest
import torch

from megatron_core import config

sys.modules.setdefault("mock", unittest.mock)  # the tests' `import mock`
torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
torch.nn.Module.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.empty_cache = lambda *args, **kwargs: None
torch.cuda.manual_seed = lambda *args, **kwargs: None
torch.cuda.manual_seed_all = lambda *args, **kwargs: None

_TIMEOUT = int(os.environ.get("MCORE_UNIT_TEST_TIMEOUT", "120"))


def pytest_addoption(parser):
    parser.addoption("--experimental", action="store_true", help="enable megatron_core experimental APIs")


@pytest.fixture(autouse=True)
def experimental(request):
    config.ENABLE_EXPERIMENTAL = request.config.getoption("--experimental") is True


@pytest.fixture(autouse=True)
def _time_limit():
    def expire(signum, frame):
        raise TimeoutError(f"test exceeded {_TIMEOUT}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(_TIMEOUT)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def _restore_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory) -> Path:
    # One directory for every rank of the run (as Megatron-LM's fixture): next to the runner's per-file store,
    # else under the session's temp root with the launcher's pid. Per-rank temp dirs made the ranks of a
    # multi-rank file save and load in different places and wait on each other until gloo's timeout.
    store = os.environ.get("MCORE_TEST_STORE")
    if store:
        path = Path(store).parent / "dist_ckpt"
    else:
        path = tmp_path_factory.getbasetemp().parent / f"dist_ckpt_{os.getppid()}"
    path.mkdir(parents=True, exist_ok=True)
    yield path
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 5:
        session.exitstatus = 0
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
