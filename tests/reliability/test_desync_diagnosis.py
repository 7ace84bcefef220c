"""Desync diagnosis: ranks calling all_reduce with different shapes get a RuntimeError naming the op and shapes.

With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (read when the process group is created, so each rank is a fresh
process) gloo compares collective fingerprints before running the op and every rank raises a
``RuntimeError``. Without it, torch 2.13's gloo aborts one rank (SIGABRT) on the size mismatch and the
other sees "Connection reset by peer", which is why CI must run distributed jobs with DETAIL on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.process_tree import communicate_all

RANK_SCRIPT = Path(__file__).resolve().parent / "_desync_rank.py"
WORLD_SIZE = 2
WALL_LIMIT_S = 60.0


def _launch_ranks(tmp: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"}
    return [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(rank), str(WORLD_SIZE), str(tmp / "store"),
             str(tmp / f"rank{rank}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for rank in range(WORLD_SIZE)
    ]


def test_shape_mismatch_raises_runtime_error_naming_op_and_shapes() -> None:
    """Every rank exits normally after a RuntimeError that names ALLREDUCE and both ranks' shapes."""
    with tempfile.TemporaryDirectory(prefix="mcore_desync_") as tmpdir:
        tmp = Path(tmpdir)
        procs = _launch_ranks(tmp)
        outputs = communicate_all(procs, WALL_LIMIT_S)
        if outputs is None:
            pytest.fail(f"the desynced ranks did not finish within {WALL_LIMIT_S:.0f}s (hang)")
        for rank, proc in enumerate(procs):
            assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{outputs[rank][-3000:]}"
        outcomes = [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    shapes = [str(o["shape"]) for o in outcomes]
    for outcome in outcomes:
        message = outcome["message"]
        assert outcome["is_runtime_error"], f"rank {outcome['rank']} did not raise a RuntimeError: {outcome}"
        assert "allreduce" in message.lower().replace("_", ""), message
        for shape in shapes:
            assert shape in message, f"rank {outcome['rank']}: shape {shape} missing from {message!r}"


def _mismatched_all_reduce() -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dist.all_reduce(torch.ones(3 + rank))  # rank 0: [3], rank 1: [4]


def test_harness_pools_with_detail_name_op_and_shapes_of_a_desync() -> None:
    """The rank pools CI runs (``MCORE_TEST_DISTRIBUTED_DEBUG=DETAIL``): a mismatched collective in a test fails
    that test with an error naming the op and both shapes, and the pool is replaced, not hung."""
    from tests.dist_harness import DistributedTestError, RankPool

    pool = RankPool(WORLD_SIZE, "DETAIL")
    try:
        with pytest.raises(DistributedTestError) as info:
            pool.run(_mismatched_all_reduce, timeout=WALL_LIMIT_S)
    finally:
        pool.close(force=True)
    message = str(info.value)
    assert "ALLREDUCE" in message and "[3]" in message and "[4]" in message, message[-2000:]
