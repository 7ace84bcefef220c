"""HybridCPDataLoaderWrapper on 4 gloo ranks (CP 2 x DP 2): schedule and moved sub-samples by hand; bad input."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from megatron_core import parallel_state as ps
from megatron_core.datasets.data_schedule import HybridCPDataLoaderWrapper, check_aligned_placement
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.process_groups_config import ProcessGroupCollection
from tests.dist_harness import run_on_ranks


def _sample(start: int, cu: list[int]) -> dict:
    n = cu[-1]
    tokens = torch.arange(start, start + n)
    return {"tokens": tokens, "labels": tokens + 1000, "loss_mask": torch.ones(n),
            "embeds": torch.stack([tokens, -tokens], dim=1).float(),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "max_seqlen": torch.tensor(max(cu))}


def _run(tp: int = 1, pp: int = 1):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=2, hybrid_context_parallel=True, distributed_timeout_minutes=1)
    # DP rank 0 (ranks 0, 1): lengths 8, 2, 3; DP rank 1 (ranks 2, 3): lengths 4, (0 dropped), 1, 5.
    if ps.get_data_parallel_rank() == 0:
        batch = [_sample(100, [0, 8, 10, 13])]
    else:
        batch = [_sample(200, [0, 4, 4]), _sample(300, [0, 1, 6])]
    config = ModelParallelConfig(context_parallel_size=2, max_seqlen_per_dp_cp_rank=4)
    if ps.get_tensor_model_parallel_rank() != 0:  # as in Megatron-LM, only TP rank 0 reads data
        out = (ps.get_data_parallel_rank(with_context_parallel=True), None, None,
               next(HybridCPDataLoaderWrapper(None, config)))
        ps.destroy_model_parallel()
        return out
    wrapper = HybridCPDataLoaderWrapper(iter([batch]), config, ProcessGroupCollection.use_mpu_process_groups())
    samples, groups = next(wrapper)
    none = HybridCPDataLoaderWrapper(None, config)
    out = (ps.get_data_parallel_rank(with_context_parallel=True), groups,
           {gid: {k: v.tolist() for k, v in s.items()} for gid, s in samples.items()}, next(none))
    ps.destroy_model_parallel()
    return out


def _check_routing(results):
    # Global ids: DP rank 0's 8, 2, 3 -> 0, 1, 2; DP rank 1's 4, 1, 5 -> 3, 4, 5. CP sizes (4 tokens a rank):
    # 8 and 5 need 2 ranks. Group 0: id 0 on ranks 0-1, id 5 on ranks 2-3; group 1: ids 3, 2, 1, 4, one rank each.
    want_groups = [[[0], [0], [5], [5]], [[3], [2], [1], [4]]]
    tokens = {0: range(100, 108), 1: range(108, 110), 2: range(110, 113), 3: range(200, 204),
              4: range(300, 301), 5: range(301, 306)}
    want_ids = {0: [0, 3], 1: [0, 2], 2: [1, 5], 3: [4, 5]}
    for rank, groups, samples, none in results:
        assert none == (None, None)
        if groups is None:
            continue
        assert groups == want_groups
        assert list(samples) == want_ids[rank], rank
        for gid, sample in samples.items():
            t = list(tokens[gid])
            assert sample["tokens"] == t and sample["labels"] == [x + 1000 for x in t]
            assert sample["loss_mask"] == [1.0] * len(t)
            assert sample["embeds"] == [[float(x), float(-x)] for x in t]
            assert set(sample) == {"tokens", "labels", "loss_mask", "embeds"}
        cp_size = {gid: sum(gid in ids for ids in group) for group in groups for gid in set().union(*group)}
        assert cp_size == {0: 2, 5: 2, 1: 1, 2: 1, 3: 1, 4: 1}


def test_schedule_and_routing_on_4_ranks():
    _check_routing(run_on_ranks(4, _run))


def test_routing_with_tp_and_pp_on_8_ranks():
    # tp=2: DP x CP groups [0, 2, 4, 6] / [1, 3, 5, 7], TP rank 1 reads nothing; pp=2: [0..3] and [4..7].
    results = run_on_ranks(8, _run, 2, 1)
    assert [r[1] is None for r in results] == [False, True] * 4
    _check_routing(results)
    _check_routing(run_on_ranks(8, _run, 1, 2))


def _bad():
    ps.initialize_model_parallel(context_parallel_size=2, hybrid_context_parallel=True, distributed_timeout_minutes=1)
    errors = []
    try:
        HybridCPDataLoaderWrapper(iter([]), SimpleNamespace(max_seqlen_per_dp_cp_rank=None))
    except ValueError as exc:
        errors.append(str(exc))
    wrapper = HybridCPDataLoaderWrapper(iter([[{"tokens": torch.arange(4), "cu_seqlens": torch.tensor([0, 3, 2])}]]),
                                        SimpleNamespace(max_seqlen_per_dp_cp_rank=4))
    try:
        next(wrapper)
    except ValueError as exc:
        errors.append(str(exc))
    ps.destroy_model_parallel()
    return errors


def test_bad_input():
    for errors in run_on_ranks(4, _bad):
        assert "max_seqlen_per_dp_cp_rank (None)" in errors[0]
        assert "cu_seqlens [0, 3, 2] of sample 0" in errors[1]
    with pytest.raises(ValueError, match=r"max_seqlen_per_dp_cp_rank \(0\)"):
        ModelParallelConfig(max_seqlen_per_dp_cp_rank=0)
    with pytest.raises(ValueError, match="hybrid_context_parallel"):
        ModelParallelConfig(hybrid_context_parallel=True)


@pytest.mark.parametrize("groups", [
    [[[0], [0], [1], [2]]],                  # a 2-rank block at ranks 0-1, two 1-rank sub-samples
    [[[5], [5], [5], [5]], [[6], [7], [8], [8]]],
])
def test_aligned_placements_pass(groups):
    check_aligned_placement(groups)


@pytest.mark.parametrize("groups,ranks", [
    ([[[0], [1], [1], [2]]], "[1, 2]"),        # a 2-rank block starting at an odd rank
    ([[[0], [0], [0], [1]]], "[0, 1, 2]"),     # three ranks: not a power of two
    ([[[0], [1], [0], [2]]], "[0, 2]"),        # not contiguous
])
def test_an_unaligned_placement_is_refused_before_it_can_hang(groups, ranks):
    with pytest.raises(ValueError, match=r"sub-sample \d+ of group 0 is placed on ranks " + re.escape(ranks)):
        check_aligned_placement(groups)
