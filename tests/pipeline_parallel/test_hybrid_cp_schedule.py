"""BalancedCPScheduler: a hand-computed schedule, Megatron-Core's scheduler as oracle (realigned where its
placement would hang), bad input."""

from __future__ import annotations

import random

import pytest

from megatron_core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler, misaligned_subsample


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


def _placements(groups: list, ids: list) -> list:
    """Per group, the sorted (sample ids, lengths, CP size) of each rank set: the placement up to rank order."""
    out = []
    for seqlens, sample_ids in zip(groups, ids):
        sets: dict[tuple, int] = {}
        for rank_lengths, rank_ids in zip(seqlens, sample_ids):
            key = (tuple(rank_ids), tuple(rank_lengths))
            sets[key] = sets.get(key, 0) + 1
        out.append(sorted(sets.items()))
    return out


# Megatron-Core's scheduler puts sample 4 (CP 4) of the last group on ranks 2-5, which are no CP group.
UNALIGNED = (8, 64, [(0, 168), (1, 393), (2, 225), (3, 112), (4, 141), (5, 416), (6, 10), (7, 392), (8, 401),
                     (9, 174), (10, 113), (11, 93), (12, 116), (13, 235), (14, 102)])


def test_unaligned_placement_is_realigned():
    n, m, samples = UNALIGNED
    groups, ids = BalancedCPScheduler(m, _Group(n)).get_groups_and_subsamples(list(samples), None)
    assert all(misaligned_subsample(group) is None for group in ids)
    assert ids[-1] == [[4], [4], [4], [4], [6], [6], [11], [11]]
    assert groups[-1] == [[141], [141], [141], [141], [10], [10], [93], [93]]


def test_matches_megatron_scheduler():
    """Megatron-Core's placement where it is aligned; where it is not (it would hang), the same rank sets moved
    onto aligned blocks."""
    ref = pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    rng = random.Random(0)
    cases = [UNALIGNED]
    for _ in range(300):
        n, m = rng.choice([2, 4, 8, 16]), rng.choice([16, 32, 64])
        cases.append((n, m, [(i, rng.randint(1, m * n)) for i in range(rng.randint(1, 20))]))
    realigned = 0
    for n, m, samples in cases:
        want = ref.BalancedCPScheduler(m, _Group(n)).get_groups_and_subsamples(list(samples), None)
        got = BalancedCPScheduler(m, _Group(n)).get_groups_and_subsamples(list(samples), None)
        assert all(misaligned_subsample(group) is None for group in got[1]), samples
        if all(misaligned_subsample(group) is None for group in want[1]):
            assert got == want, samples
        else:
            realigned += 1
            assert _placements(*got) == _placements(*want), samples
    assert realigned >= 1


def test_bad_input():
    with pytest.raises(ValueError, match=r"max_seq_len_per_rank \(0\)"):
        BalancedCPScheduler(0, _Group(4))
    with pytest.raises(ValueError, match=r"\(0, 17\).*4 DP x CP ranks.*max_seq_len_per_rank=4"):
        BalancedCPScheduler(4, _Group(4)).get_groups_and_subsamples([(0, 17), (1, 2)], None)
