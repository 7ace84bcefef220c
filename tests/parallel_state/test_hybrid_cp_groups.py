"""Hybrid DP x CP groups (hybrid_context_parallel) on 4 and 8 gloo ranks against hand-written rank lists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.parallel_state import ParallelConfigError
from megatron_core.parallel_state.hybrid_cp import hybrid_dp_cp_group_sizes, hybrid_dp_cp_rank_lists
from tests.dist_harness import run_on_ranks


def _observe(layouts):
    """Per layout: this rank's hybrid group of each size, the full list of slices, and an all-reduce over each."""
    out = []
    for tp, pp, cp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, hybrid_context_parallel=True,
                                     distributed_timeout_minutes=1)
        dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
        seen = {}
        for size in [*hybrid_dp_cp_group_sizes(dp_cp), dp_cp]:
            group = ps.get_hybrid_data_context_parallel_groups(group_size=size)
            total = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(total, group=group)
            seen[size] = (dist.get_process_group_ranks(group), total.item())
        all_slices = {size: ps.get_all_group_ranks(f"hybrid_dp_cp_{size}") for size in hybrid_dp_cp_group_sizes(dp_cp)}
        full_is_dp_cp = ps.get_hybrid_data_context_parallel_groups(group_size=dp_cp) is \
            ps.get_data_parallel_group(with_context_parallel=True)
        out.append((seen, all_slices, full_is_dp_cp))
        ps.destroy_model_parallel()
    return dist.get_rank(), out


def _membership(slices, rank):
    return next(members for members in slices if rank in members)


def _check(world, layouts, expected):
    for rank, observed in run_on_ranks(world, _observe, layouts):
        for layout, (seen, all_slices, full_is_dp_cp), want in zip(layouts, observed, expected, strict=True):
            assert all_slices == {size: slices for size, slices in want.items() if size != "full"}, layout
            assert full_is_dp_cp, layout
            for size, slices in want.items():
                members = _membership(slices, rank)
                key = len(members)
                assert seen[key][0] == members, (layout, rank, size)
                assert seen[key][1] == float(sum(members)), (layout, rank, size)


def test_hybrid_groups_on_4_ranks():
    # (tp, pp, cp); order tp-cp-ep-dp-pp, so the DP x CP groups are [0, 1, 2, 3] and [0, 2] / [1, 3].
    layouts = [(1, 1, 2), (1, 1, 1), (2, 1, 1)]
    expected = [
        {2: [[0, 1], [2, 3]], "full": [[0, 1, 2, 3]]},
        {2: [[0, 1], [2, 3]], "full": [[0, 1, 2, 3]]},
        {"full": [[0, 2], [1, 3]]},  # DP x CP size 2: no slices below it
    ]
    _check(4, layouts, expected)


def test_hybrid_groups_on_8_ranks():
    layouts = [(1, 1, 2), (2, 1, 2), (1, 2, 2)]
    expected = [
        {2: [[0, 1], [2, 3], [4, 5], [6, 7]], 4: [[0, 1, 2, 3], [4, 5, 6, 7]], "full": [list(range(8))]},
        # tp=2: DP x CP groups [0, 2, 4, 6] and [1, 3, 5, 7]
        {2: [[0, 2], [4, 6], [1, 3], [5, 7]], "full": [[0, 2, 4, 6], [1, 3, 5, 7]]},
        # pp=2: DP x CP groups [0..3] and [4..7]
        {2: [[0, 1], [2, 3], [4, 5], [6, 7]], "full": [[0, 1, 2, 3], [4, 5, 6, 7]]},
    ]
    _check(8, layouts, expected)


def _errors():
    out = {}
    ps.initialize_model_parallel(context_parallel_size=2, distributed_timeout_minutes=1)
    try:  # not built without hybrid_context_parallel, except the full DP x CP size
        ps.get_hybrid_data_context_parallel_groups(group_size=2)
    except ValueError as exc:
        out["not_built"] = str(exc)
    out["unchecked"] = ps.get_hybrid_data_context_parallel_groups(check_initialized=False, group_size=2)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2, hybrid_context_parallel=True, distributed_timeout_minutes=1)
    try:
        ps.get_hybrid_data_context_parallel_groups(group_size=3)
    except ValueError as exc:
        out["bad_size"] = str(exc)
    ps.destroy_model_parallel()
    out["after_destroy"] = ps.get_hybrid_data_context_parallel_groups(check_initialized=False, group_size=2)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=4, hybrid_context_parallel=True,
                                     distributed_timeout_minutes=1)
    except ParallelConfigError as exc:
        out["odd"] = str(exc)
    ps.destroy_model_parallel()
    return out


def test_hybrid_group_errors():
    for out in run_on_ranks(4, _errors):
        assert "group_size=2" in out["not_built"] and "[4]" in out["not_built"]
        assert out["unchecked"] is None and out["after_destroy"] is None
        assert "group_size=3" in out["bad_size"] and "[2, 4]" in out["bad_size"]
        assert "= 1" in out["odd"] and "even" in out["odd"]


def test_group_sizes_and_slices():
    assert hybrid_dp_cp_group_sizes(2) == [] and hybrid_dp_cp_group_sizes(6) == [2]
    assert hybrid_dp_cp_group_sizes(16) == [2, 4, 8]
    assert hybrid_dp_cp_rank_lists([1, 3, 5, 7, 9, 11]) == {2: [[1, 3], [5, 7], [9, 11]]}
    with pytest.raises(ValueError, match=r"= 5"):
        hybrid_dp_cp_group_sizes(5)


def _create_standalone():
    groups = ps.create_hybrid_dp_cp_groups(dist.get_rank(), [0, 1, 2, 3])
    out = {size: dist.get_process_group_ranks(group) for size, group in groups.items()}
    for group in groups.values():
        dist.destroy_process_group(group)
    return out


def test_create_hybrid_dp_cp_groups_standalone():
    results = run_on_ranks(4, _create_standalone)
    assert results == [{2: [0, 1]}, {2: [0, 1]}, {2: [2, 3]}, {2: [2, 3]}]
