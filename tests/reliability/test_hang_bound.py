"""Hang bound: a rank withheld from a collective makes every other rank raise within the timeout + 10 s.

Three gloo ranks from the shared pool build a subgroup with a short timeout; rank 0 never enters an
``all_reduce`` on it that ranks 1 and 2 call. The waiting ranks must raise a ``RuntimeError`` (or a
subclass such as ``DistBackendError``; torch 2.13's gloo raises a plain ``RuntimeError`` "Timed out
waiting 5000ms for send/recv operation to complete") no later than the subgroup timeout + 10 s, the pool
must stay usable afterwards, and no process may be left behind.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.dist_harness import get_pool, run_on_ranks
from tests.process_tree import descendants

WORLD_SIZE = 3
GROUP_TIMEOUT_S = 5.0
BOUND_S = GROUP_TIMEOUT_S + 10.0


def _withhold_rank0(timeout_s: float) -> dict[str, Any]:
    """Ranks 1.. call all_reduce on a subgroup that rank 0 never joins; each reports what it saw."""
    rank = dist.get_rank()
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    outcome: dict[str, Any] = {"rank": rank, "error": None, "is_runtime_error": False, "message": "", "elapsed": 0.0}
    if rank != 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(16), group=group)
        except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
            outcome.update(error=type(exc).__name__, is_runtime_error=isinstance(exc, RuntimeError),
                           message=str(exc)[:400])
        outcome["elapsed"] = time.monotonic() - start
    # Rank 0 stays out of the subgroup's collective until every waiting rank has given up.
    dist.barrier()
    dist.destroy_process_group(group)
    return outcome


def _rank_sum() -> float:
    """All-reduce of the ranks on the default group (checks the pool still works)."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_withheld_rank_makes_others_raise_within_bound() -> None:
    """Every rank waiting on a withheld peer raises a RuntimeError within timeout + 10 s; nothing is leaked."""
    expected_sum = float(sum(range(WORLD_SIZE)))
    assert run_on_ranks(WORLD_SIZE, _rank_sum) == [expected_sum] * WORLD_SIZE  # pool up before timing anything
    before = descendants(os.getpid())
    outcomes = run_on_ranks(WORLD_SIZE, _withhold_rank0, GROUP_TIMEOUT_S, timeout=BOUND_S + 30)
    for outcome in outcomes[1:]:
        assert outcome["is_runtime_error"], f"rank {outcome['rank']} did not raise a RuntimeError: {outcome}"
        assert outcome["elapsed"] <= BOUND_S, f"rank {outcome['rank']} raised after {outcome['elapsed']:.1f}s"
    assert run_on_ranks(WORLD_SIZE, _rank_sum, timeout=30) == [expected_sum] * WORLD_SIZE
    assert get_pool(WORLD_SIZE).alive()
    assert descendants(os.getpid()) == before, "processes were started or lost by the hang"
