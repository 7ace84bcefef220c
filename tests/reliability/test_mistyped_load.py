"""A mistyped ``--load`` must not train from scratch (``examples/pretrain_gpt.py``, one process).

- ``--load no_such_dir`` exits non-zero naming the directory, before any training step;
- ``--load-if-present`` starts from scratch when nothing is there;
- ``--load D --save D`` (the resumable-job pattern) starts fresh while ``D`` is absent, then
  resumes from the tracker on the next run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"
MODEL = ["--model-preset", "tiny", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
         "--ffn-hidden-size", "32", "--seq-length", "8", "--max-position-embeddings", "8", "--mock-data",
         "--vocab-size", "64", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "0",
         "--eval-iters", "1", "--no-progress", "--seed", "3"]


def _run(*extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run([sys.executable, str(SCRIPT), *MODEL, *extra], cwd=REPO, text=True, capture_output=True,
                          timeout=240, env={**env, "OMP_NUM_THREADS": "1"})


def test_missing_load_directory_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_dir"
    proc = _run("--train-iters", "2", "--load", str(missing))
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert str(missing) in proc.stderr and "does not exist" in proc.stderr, proc.stderr[-2000:]
    assert "[train]" not in proc.stdout


@pytest.mark.slow
def test_load_if_present_and_the_resumable_job_pattern(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # The --load-if-present run is independent of the resumable job's first run: the two (one process each) run
    # side by side on two cores.
    with ThreadPoolExecutor(1) as pool:
        if_present = pool.submit(_run, "--train-iters", "1", "--load", str(tmp_path / "nothing"), "--load-if-present")
        first = _run("--train-iters", "2", "--load", str(run_dir), "--save", str(run_dir), "--save-interval", "2")
        proc = if_present.result(timeout=300)  # the run itself is bounded at 240 s
    assert proc.returncode == 0, proc.stderr[-2000:]

    assert first.returncode == 0, first.stderr[-2000:]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    second = _run("--train-iters", "3", "--load", str(run_dir), "--save", str(run_dir), "--save-interval", "3")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "start at 2" in second.stdout + second.stderr
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
