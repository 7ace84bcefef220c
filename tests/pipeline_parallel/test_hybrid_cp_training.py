"""Hybrid context parallelism end to end on 4 gloo ranks: one training step equals one process on the same samples.

Three layouts of the 4 ranks: DP=2 x CP=2 (sub-samples of CP size 1 and 2, the size-2 groups equal to the
static CP groups), DP=4 x CP=1 (CP sizes 1, 2 and 4 while the layers' own CP group has one rank, so attention
must take each sub-sample's group from ``PackedSeqParams``) and DP=2 x TP=2 (TP rank 0 reads the data and
broadcasts the sub-sample counts and CP sizes). Each rank must run the sub-samples the scheduler gave it, in
order, with the CP size and group the scheduler implies; loss and every gradient match within 1e-5.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel import hybrid_cp_cases

TWO = [0, 1]
HIGH = [2, 3]
ALL = [0, 1, 2, 3]

# Per DP x CP rank: (sub-sample id, CP size, global ranks of its CP group or None) in the order run.
# Scheduler output (max 8 tokens a rank), DP=2 x CP=2, lengths 16, 6, 5, 12, 8, 3, 2, 4, 3:
#   [[[0], [0], [3], [3]], [[4], [1], [2, 8], [7, 5, 6]]]
EXPECTED_DP2_CP2 = {
    0: [(0, 2, TWO), (4, 1, None)],
    1: [(0, 2, TWO), (1, 1, None)],
    2: [(3, 2, HIGH), (2, 1, None), (8, 1, None)],
    3: [(3, 2, HIGH), (7, 1, None), (5, 1, None), (6, 1, None)],
}
# DP=4 x CP=1, lengths 32, 5, 16, 4, 12, 7, 6: [[[0], [0], [0], [0]], [[2], [2], [4], [4]], [[5], [6], [1], [3]]]
EXPECTED_DP4 = {
    0: [(0, 4, ALL), (2, 2, TWO), (5, 1, None)],
    1: [(0, 4, ALL), (2, 2, TWO), (6, 1, None)],
    2: [(0, 4, ALL), (4, 2, HIGH), (1, 1, None)],
    3: [(0, 4, ALL), (4, 2, HIGH), (3, 1, None)],
}
# DP=2 x TP=2 (DP x CP = 2 ranks), the DP=2 lengths: [[[0, 3], [0, 3]], [[4, 5, 8], [1, 2, 7, 6]]]
EXPECTED_TP2 = {
    0: [(0, 2), (3, 2), (4, 1), (5, 1), (8, 1)],
    1: [(0, 2), (3, 2), (1, 1), (2, 1), (7, 1), (6, 1)],
}


@pytest.mark.parametrize("dp, expected", [(2, EXPECTED_DP2_CP2), (4, EXPECTED_DP4)], ids=["dp2xcp2", "dp4xcp1"])
def test_one_step_matches_single_process(dp, expected):
    results = run_on_ranks(4, hybrid_cp_cases.train_one_step, dp)
    for result in results:
        assert result["checked"] > 0
        assert [tuple(r) for r in result["record"]] == expected[result["hdp_rank"]], result["hdp_rank"]


def test_tensor_parallel_ranks_follow_rank_0():
    for result in run_on_ranks(4, hybrid_cp_cases.train_one_step, 2, 2):
        assert result["checked"] > 0
        want = EXPECTED_TP2[result["hdp_rank"]]
        # Only TP rank 0 reads the data and sees the sample ids; TP rank 1 gets the counts and sizes by broadcast.
        want_ids = [sid for sid, _ in want] if result["tp_rank"] == 0 else [None] * len(want)
        dp_cp_group = [0, 2] if result["tp_rank"] == 0 else [1, 3]
        assert [tuple(r) for r in result["record"]] == [
            (sid, size, dp_cp_group if size == 2 else None) for sid, (_, size) in zip(want_ids, want)]
