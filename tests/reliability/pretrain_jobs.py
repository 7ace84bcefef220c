"""Run several ``pretrain_gpt.py`` command lines at once and read their JSON training logs (a test helper)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.process_tree import communicate_all


def train_records(commands: list[list[str]], logs: list[Path], cwd: Path, wall_limit_s: float) -> list[list[dict]]:
    """Start every command (each writes ``--log-json`` to its log), wait at most ``wall_limit_s`` each, and return
    each run's ``train`` records; a failure or a timeout fails the test with the run's output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd in commands]
    outputs = communicate_all(procs, wall_limit_s)
    if outputs is None:
        pytest.fail(f"pretrain_gpt.py did not finish within {wall_limit_s:.0f}s")
    runs = []
    for proc, out, log in zip(procs, outputs, logs):
        assert proc.returncode == 0, f"pretrain_gpt.py failed ({proc.returncode}):\n{out[-4000:]}"
        runs.append([r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"])
    return runs
