"""BalancedCPScheduler: a hand-computed schedule, Megatron-Core's scheduler as oracle, bad input."""

from __future__ import annotations

import random

import pytest

from megatron_core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_hand_computed_schedule():
    # max 4 tokens a rank: lengths 8 and 5 need CP 2, the rest CP 1.
    sched = BalancedCPScheduler(4, _Group(4))
    samples = [(0, 8), (1, 2), (2, 3), (3, 4), (4, 1), (5, 5)]
    groups, ids = sched.get_groups_and_subsamples(samples, None)
    assert ids == [[[0], [0], [5], [5]], [[3], [2], [1], [4]]]
    assert groups == [[[8], [8], [5], [5]], [[4], [3], [2], [1]]]
    assert [sched.gpus_needed(n) for n in (1, 4, 5, 8, 9, 16)] == [1, 1, 2, 2, 4, 4]
    assert sched.get_total_workload(8) == 32.0 and sched.get_total_workload(8, 4) == 16.0


def test_empty_ranks_are_filled_by_widening():
    # One CP-1 sample on 4 ranks: widened to 2, then 4 ranks.
    groups, ids = BalancedCPScheduler(4, _Group(4)).get_groups_and_subsamples([(0, 3)], None)
    assert ids == [[[0], [0], [0], [0]]] and groups == [[[3], [3], [3], [3]]]


def test_matches_megatron_scheduler():
    ref = pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    rng = random.Random(0)
    for _ in range(300):
        n, m = rng.choice([2, 4, 8, 16]), rng.choice([16, 32, 64])
        samples = [(i, rng.randint(1, m * n)) for i in range(rng.randint(1, 20))]
        want = ref.BalancedCPScheduler(m, _Group(n)).get_groups_and_subsamples(list(samples), None)
        assert BalancedCPScheduler(m, _Group(n)).get_groups_and_subsamples(list(samples), None) == want, samples


def test_bad_input():
    with pytest.raises(ValueError, match=r"max_seq_len_per_rank \(0\)"):
        BalancedCPScheduler(0, _Group(4))
    with pytest.raises(ValueError, match=r"\(0, 17\).*4 DP x CP ranks.*max_seq_len_per_rank=4"):
        BalancedCPScheduler(4, _Group(4)).get_groups_and_subsamples([(0, 17), (1, 2)], None)
