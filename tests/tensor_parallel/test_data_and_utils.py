"""broadcast_data (TP rank 0 loads, its TP peers receive) and the 1-D split/gather helpers."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from megatron_core import parallel_state
from megatron_core import tensor_parallel as tp
from tests.dist_harness import run_on_ranks

WORLD = 4


def _batch(dp_rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dp_rank)
    return {
        "tokens": torch.randint(0, 50, (2, 7), generator=g),
        "labels": torch.randint(0, 50, (2, 7), generator=g),
        "position_ids": torch.arange(7).repeat(2, 1, 1),
    }


def _check_broadcast(tp_size: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    keys = ["tokens", "labels", "position_ids"]
    expected = _batch(dp_rank)
    received = tp.broadcast_data(keys, expected if tp_rank == 0 else None, torch.int64)
    assert list(received) == keys
    for key in keys:
        assert_close(received[key], expected[key], rtol=0, atol=0)
    bad = dict(expected, labels=expected["labels"].float())
    message = "dtype torch.float32" if tp_rank == 0 else "TP rank 0 rejected its batch"
    with pytest.raises(ValueError, match=message):
        tp.broadcast_data(keys, bad if tp_rank == 0 else None, torch.int64)

    # 1-D split and gather round trip
    tensor = torch.arange(24.0).reshape(2, 3, 4)
    chunk = tp.split_tensor_into_1d_equal_chunks(tensor)
    assert_close(chunk, tensor.reshape(-1).chunk(tp_size)[tp_rank])
    assert_close(tp.gather_split_1d_tensor(chunk), tensor.reshape(-1))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_broadcast_data_and_1d_chunks(tp_size: int) -> None:
    run_on_ranks(WORLD, _check_broadcast, tp_size)


def test_broadcast_data_checks_dtype_and_shape() -> None:
    with pytest.raises(ValueError, match="'labels' has dtype torch.float32, expected torch.int64"):
        tp.broadcast_data(["tokens", "labels"], {"tokens": torch.zeros(2, dtype=torch.long),
                                                 "labels": torch.zeros(2)}, torch.int64)
    with pytest.raises(ValueError, match="needs 1 to 5 non-empty dims"):
        tp.broadcast_data(["x"], {"x": torch.zeros(1, 1, 1, 1, 1, 1, dtype=torch.long)}, torch.int64)


def test_split_tensor_along_last_dim() -> None:
    tensor = torch.arange(12.0).reshape(2, 6)
    parts = tp.split_tensor_along_last_dim(tensor, 3, contiguous_split_chunks=True)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert all(p.is_contiguous() for p in parts)
    with pytest.raises(ValueError, match=r"last dimension \(6\) is not divisible by num_partitions \(4\)"):
        tp.split_tensor_along_last_dim(tensor, 4)
