"""Section 7, check 1: one rank of a 2-rank save is SIGKILLed mid-write; the run resumes bit-exactly.

``examples/pretrain_gpt.py`` trains a tiny GPT on 2 gloo ranks under torchrun (TP=2, so each rank writes
its own shard file), saving every 3 iterations. While the checkpoint of iteration 6 is being written,
rank 1 writes half of a buffer of its shard file and kills itself with SIGKILL
(``_crash_during_save.py``). Then: the job fails, the tracker still names iteration 3, iteration 6
is not published, and a restart from the same directory loads iteration 3 and logs, for each of the
following 7 steps, exactly (bitwise) the loss and gradient norm of an uninterrupted run.
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

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"
CRASHER = Path(__file__).resolve().parent / "_crash_during_save.py"
TRAIN_ITERS, SAVE_INTERVAL, CRASH_AT = 10, 3, 6
FLAGS = ["--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
         "--vocab-size", "200", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "1", "--no-progress", "--seed", "11",
         "--tensor-model-parallel-size", "2"]


class _Jobs:
    """torchrun jobs of one test, run side by side; each writes its output to a file (no pipe to fill while
    another job is being waited for); ``kill_all`` ends whatever is still running."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.running: dict[subprocess.Popen, Path] = {}

    def start(self, script: Path, extra: list[str], log: Path,
              env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(script), *FLAGS, *extra, "--log-json", str(log)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
               **(env_extra or {})}
        out = self.out_dir / f"{log.stem}.out"
        with out.open("w") as sink:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        self.running[proc] = out
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float = 280) -> tuple[int, str]:
        """Wait for ``proc``; return its exit code and output (on a timeout, kill every job and fail)."""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"torchrun did not finish within {timeout}s:\n{self.running[proc].read_text()[-4000:]}")
        return proc.returncode, self.running.pop(proc).read_text()

    def kill_all(self) -> None:
        """Kill the process tree of every job still running."""
        for proc in list(self.running):
            if proc.poll() is None:
                kill_tree(proc)


def _train(log: Path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {r["iteration"]: (r["lm loss"], r["grad norm"]) for r in records if r["kind"] == "train"}


@pytest.mark.slow
@pytest.mark.timeout(900)  # three torchrun jobs of 2 ranks (two at a time); about 40 s on a busy 2-core machine
def test_rank_killed_mid_save_resumes_from_previous_checkpoint_bit_exactly(tmp_path: Path) -> None:
    # The uninterrupted run is independent of the crashed one: both run at once (the crashed run, then the
    # resumed one, is the critical path; the 2-rank jobs spend most of their time importing, mostly 1 core each).
    jobs = _Jobs(tmp_path)
    try:
        _check_crash_and_resume(tmp_path, jobs)
    finally:
        jobs.kill_all()


def _check_crash_and_resume(tmp_path: Path, jobs: _Jobs) -> None:
    save, marker = tmp_path / "ckpt", tmp_path / "crash.json"
    straight_job = jobs.start(SCRIPT, [], tmp_path / "straight.jsonl")
    crashed_job = jobs.start(CRASHER, ["--save", str(save), "--save-interval", str(SAVE_INTERVAL)],
                             tmp_path / "crashed.jsonl",
                             {"CRASH_RANK": "1", "CRASH_ITERATION": str(CRASH_AT), "CRASH_MARKER": str(marker)})
    code, out = jobs.finish(crashed_job)
    assert code != 0, "the job whose rank 1 was killed exited 0"
    crash = json.loads(marker.read_text())
    assert crash["rank"] == 1 and 0 < crash["bytes_written"] < crash["bytes_total"]
    shard = Path(crash["file"])
    assert shard.name.startswith("__1_") and shard.parent.name.startswith(f"iter_{CRASH_AT:07d}.tmp-")
    assert shard.stat().st_size == crash["bytes_written"]  # the kill landed mid-file
    crashed = _train(tmp_path / "crashed.jsonl")
    assert sorted(crashed) == list(range(1, CRASH_AT + 1))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_INTERVAL)
    assert not (save / f"iter_{CRASH_AT:07d}").exists(), "a checkpoint whose rank died mid-write was published"

    resumed_job = jobs.start(SCRIPT, ["--load", str(save), "--save", str(save), "--save-interval",
                                     str(SAVE_INTERVAL)], tmp_path / "resumed.jsonl")
    code, out = jobs.finish(straight_job)
    assert code == 0, out[-4000:]
    straight = _train(tmp_path / "straight.jsonl")
    assert sorted(straight) == list(range(1, TRAIN_ITERS + 1))
    code, out = jobs.finish(resumed_job)
    assert code == 0, out[-4000:]
    resumed = _train(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(SAVE_INTERVAL + 1, TRAIN_ITERS + 1))
    assert len(resumed) >= 5
    for iteration, (loss, norm) in resumed.items():
        assert (loss, norm) == straight[iteration], (
            f"iteration {iteration}: resumed (loss, grad norm) {(loss, norm)!r} != uninterrupted "
            f"{straight[iteration]!r}")
    # The resumed run saved iteration 6 over the crashed attempt's leftovers and published it.
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    assert (save / f"iter_{CRASH_AT:07d}").is_dir()
