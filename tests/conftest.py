"""Shared pytest set-up: GPU marker handling, cleanup of the distributed rank pools, and a
suite-wide check that no test leaves a child process behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.dist_harness import close_all_pools
from tests.process_tree import descendants

# Helpers Python itself keeps alive until the interpreter exits; not left behind by a test.
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _left_behind() -> dict[int, str]:
    out = {}
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if not cmdline.strip():  # a zombie: exited, only not yet reaped
            continue
        if not any(helper in cmdline for helper in _INTERPRETER_HELPERS):
            out[pid] = cmdline.strip()[:200]
    return out


def pytest_sessionfinish(session, exitstatus):
    close_all_pools()
    deadline = time.monotonic() + 15
    left = _left_behind()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _left_behind()
    if left:
        lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        print(f"\nERROR: processes left behind by the test session:\n{lines}", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
