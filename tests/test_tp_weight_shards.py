"""``model_parallel_config.resolve_tensor_parallel_weight_shards`` (Megatron-Core 0.19)."""

from __future__ import annotations

import pytest

from megatron_core.model_parallel_config import resolve_tensor_parallel_weight_shards


@pytest.mark.parametrize("tp, remat, expected", [(1, 1, (1, 1)), (4, 1, (4, 1)), (2, 3, (6, 3))])
def test_shard_count_derived_when_not_given(tp, remat, expected):
    assert resolve_tensor_parallel_weight_shards(tp, None, remat) == expected


@pytest.mark.parametrize("tp, shards, expected", [(2, 2, (2, 1)), (2, 8, (8, 4)), (4, 12, (12, 3))])
def test_given_shard_count_sets_the_remat_size(tp, shards, expected):
    # the remat size passed in is ignored when the shard count is given
    assert resolve_tensor_parallel_weight_shards(tp, shards, 7) == expected


def test_idempotent():
    first = resolve_tensor_parallel_weight_shards(4, 16, 1)
    assert resolve_tensor_parallel_weight_shards(4, *first) == first
    derived = resolve_tensor_parallel_weight_shards(2, None, 5)
    assert resolve_tensor_parallel_weight_shards(2, *derived) == derived


def test_fewer_shards_than_tp_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_num_weight_shards \(2\) must be >= "
                                         r"tensor_model_parallel_size \(4\)"):
        resolve_tensor_parallel_weight_shards(4, 2, 1)


def test_shards_not_a_multiple_of_tp_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_num_weight_shards \(6\) must be divisible by "
                                         r"tensor_model_parallel_size \(4\)"):
        resolve_tensor_parallel_weight_shards(4, 6, 1)


def test_field_names_in_errors_can_be_renamed():
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_num_weight_shards \(3\) must be divisible by "
                                         r"expert_tensor_parallel_size \(2\)"):
        resolve_tensor_parallel_weight_shards(2, 3, 1, shards_field="expert_tensor_parallel_num_weight_shards",
                                              tp_field="expert_tensor_parallel_size")


def test_tp_size_below_one_is_refused():
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be >= 1, got 0"):
        resolve_tensor_parallel_weight_shards(0, None, 1)
