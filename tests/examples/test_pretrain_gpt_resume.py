"""``examples/pretrain_gpt.py`` under torchrun on 4 CPU ranks: trains, checkpoints, is killed, resumes.

A run saving every SAVE_INTERVAL iterations kills itself (every rank, SIGKILL) at the end of iteration
KILL_AT through the example's ``PRETRAIN_GPT_KILL_AT_ITERATION`` test hook, so the last published
checkpoint is known (the second one, 6) however loaded the machine is. Up to the kill that run is an
uninterrupted run: the run resumed from iteration 6 must log exactly (bitwise) its losses for iterations 7
and 8, which it trained after the checkpoint.

The two runs of a layout share one ``--data-cache-path``: the first run's rank 0 builds the mock data's
indices (millions of samples) and the second run loads them, as Megatron's runs do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.process_tree import kill_tree

pytestmark = pytest.mark.slow  # subprocess/torchrun training runs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"
TRAIN_ITERS, SAVE_INTERVAL, KILL_AT = 2000, 3, 8
MODEL = ["--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
         "--vocab-size", "200", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "1", "--no-progress", "--seed", "7"]
LAYOUTS = {"tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
           "dp2_tp2": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]}


def _launch(extra: list[str], log: Path, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT), *MODEL, *extra, "--log-json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 240, expect_success: bool = True) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = kill_tree(proc)
        pytest.fail(f"pretrain_gpt.py did not finish within {timeout}s:\n{out[-4000:]}")
    if expect_success:
        assert proc.returncode == 0, f"pretrain_gpt.py failed ({proc.returncode}):\n{out[-4000:]}"
    return out


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
    parallel = [*LAYOUTS[layout], "--data-cache-path", str(tmp_path / "data_cache")]
    save = tmp_path / "ckpt"
    killed_log = tmp_path / "killed.jsonl"
    killed = _launch([*parallel, "--save", str(save), "--save-interval", str(SAVE_INTERVAL)], killed_log,
                     {"PRETRAIN_GPT_KILL_AT_ITERATION": str(KILL_AT)})
    out = _finish(killed, expect_success=False)
    assert killed.returncode != 0, f"the killed run exited cleanly:\n{out[-4000:]}"
    uninterrupted = _train_losses(killed_log)  # the killed run is uninterrupted up to the kill
    assert sorted(uninterrupted) == list(range(1, KILL_AT + 1)), "the run did not stop at the kill iteration"
    resumed_from = _tracker(save)
    assert resumed_from == KILL_AT // SAVE_INTERVAL * SAVE_INTERVAL, f"tracker at {resumed_from} after the kill"
    assert KILL_AT - resumed_from >= 2  # at least two iterations trained after the checkpoint to compare

    resumed_log = tmp_path / "resumed.jsonl"
    _finish(_launch([*parallel, "--load", str(save), "--save", str(save), "--exit-interval", str(KILL_AT)],
                    resumed_log))
    resumed = _train_losses(resumed_log)
    assert sorted(resumed) == list(range(resumed_from + 1, KILL_AT + 1))
    for iteration, loss in resumed.items():
        assert loss == uninterrupted[iteration], (
            f"iteration {iteration}: resumed {loss!r} != uninterrupted {uninterrupted[iteration]!r}")


def test_refuses_to_replace_published_checkpoints_before_training(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("10\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), *MODEL, "--save", str(save)], cwd=REPO, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "already holds checkpoints up to iteration 10" in proc.stderr
    assert "[train]" not in proc.stdout
