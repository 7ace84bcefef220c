"""``examples/pretrain_gpt.py`` under torchrun on 4 CPU ranks: trains, checkpoints, is killed, resumes.

A run is killed with SIGKILL once it has written at least two checkpoints; the resumed run must
log exactly (bitwise) the losses of an uninterrupted run for every later iteration.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.process_tree import kill_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"
TRAIN_ITERS, STOP_AT = 2000, 14
MODEL = ["--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
         "--vocab-size", "200", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "1", "--no-progress", "--seed", "7"]
LAYOUTS = {"tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
           "dp2_tp2": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(SCRIPT), *MODEL, *extra, "--log-json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = kill_tree(proc)
        pytest.fail(f"pretrain_gpt.py did not finish within {timeout}s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"pretrain_gpt.py failed ({proc.returncode}):\n{out[-4000:]}"


def _train_losses(log: Path) -> dict[int, float]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["iteration"]: r["lm loss"] for r in records if r["kind"] == "train"}


def _tracker(save_dir: Path) -> int:
    path = save_dir / "latest_checkpointed_iteration.txt"
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_killed_run_resumes_with_identical_losses(tmp_path: Path, layout: str) -> None:
    parallel = LAYOUTS[layout]
    straight_log = tmp_path / "straight.jsonl"
    _finish(_launch([*parallel, "--exit-interval", str(STOP_AT)], straight_log))
    straight = _train_losses(straight_log)
    assert sorted(straight) == list(range(1, STOP_AT + 1))

    save = tmp_path / "ckpt"
    killed = _launch([*parallel, "--save", str(save), "--save-interval", "3"], tmp_path / "killed.jsonl")
    deadline = time.monotonic() + 180
    while _tracker(save) < 6 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    still_running = killed.poll() is None
    kill_tree(killed)
    assert still_running, "the run to be killed ended on its own"
    resumed_from = _tracker(save)
    assert 6 <= resumed_from < STOP_AT, f"kill landed at checkpoint {resumed_from}"

    resumed_log = tmp_path / "resumed.jsonl"
    _finish(_launch([*parallel, "--load", str(save), "--save", str(save), "--exit-interval", str(STOP_AT)],
                    resumed_log))
    resumed = _train_losses(resumed_log)
    assert sorted(resumed) == list(range(resumed_from + 1, STOP_AT + 1))
    for iteration, loss in resumed.items():
        assert loss == straight[iteration], f"iteration {iteration}: resumed {loss!r} != straight {straight[iteration]!r}"


def test_refuses_to_replace_published_checkpoints_before_training(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("10\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), *MODEL, "--save", str(save)], cwd=REPO, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "already holds checkpoints up to iteration 10" in proc.stderr
    assert "[train]" not in proc.stdout
