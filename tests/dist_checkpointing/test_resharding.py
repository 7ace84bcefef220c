"""Save under one (TP, PP, DP) layout on 4 ranks, load under others; validation, fully parallel and async save."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.dist_checkpointing import (
    AsyncCallsQueue,
    CheckpointingException,
    ShardedTensor,
    check_is_distributed_checkpoint,
    load,
    load_plain_tensors,
    load_tensors_metadata,
    save,
)
from megatron_core.dist_checkpointing.strategies import (
    FullyParallelSaveStrategyWrapper,
    TorchDistSaveShardedStrategy,
)
from tests.dist_checkpointing.sharded_fixtures import (
    assert_same,
    build_state_dict,
    expected_state_dict,
    global_tensor,
)
from tests.dist_harness import run_on_ranks

WORLD = 4
LOAD_LAYOUTS = [(1, 1), (2, 1), (1, 2), (4, 1), (1, 4), (2, 2)]


def _save_then_load_everywhere(ckpt_dir: str, save_layout: tuple[int, int]) -> bool:
    parallel_state.initialize_model_parallel(*save_layout)
    save(build_state_dict(), ckpt_dir)
    for tp, pp in LOAD_LAYOUTS:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, pp)
        same = (tp, pp) == tuple(save_layout)
        loaded = load(build_state_dict(empty=True, with_rng=same), ckpt_dir)
        assert_same(loaded, expected_state_dict(with_rng=same), f"layout tp={tp} pp={pp}")
        if not same:
            try:
                load(build_state_dict(empty=True), ckpt_dir)
            except CheckpointingException as e:
                assert "the object grid differs" in str(e), e
            else:
                raise AssertionError("a per-rank object loaded under a different layout")
    return True


@pytest.mark.parametrize("save_layout", [(2, 2), (1, 1)])
def test_reshard_across_layouts(tmp_path, save_layout):
    ckpt = str(tmp_path / "ckpt")
    assert all(run_on_ranks(WORLD, _save_then_load_everywhere, ckpt, save_layout))
    assert check_is_distributed_checkpoint(ckpt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    meta = load_tensors_metadata(ckpt)
    assert meta["layers.w"].global_shape == (4, 8, 6)
    plain = load_plain_tensors(ckpt)
    for key in ("col", "row", "rep", "layers.w", "fc1"):
        assert torch.equal(plain[key], global_tensor(key)), key


def _bad_sharding(ckpt_dir: str, kind: str) -> str:
    rank = torch.distributed.get_rank()
    if kind == "duplicate":
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank // 2, 2))}
    elif kind == "overlap":
        sd = {"w": ShardedTensor("w", torch.zeros(2), torch.float32, (2,), (5,), (rank,), None)}
    elif kind == "gap":
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, 5))}
    else:
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2 + rank % 2), replica_id=rank)}
    try:
        save(sd, ckpt_dir)
    except CheckpointingException as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind, message", [
    ("duplicate", "has 2 main replicas"),
    ("overlap", "main-replica shards overlap"),
    ("gap", "cover 8 of 10 elements"),
    ("shape", "ranks disagree on global_shape"),
])
def test_invalid_sharding_raises_on_every_rank(tmp_path, kind, message):
    errors = run_on_ranks(WORLD, _bad_sharding, str(tmp_path / "bad"), kind)
    assert all(message in e for e in errors), errors
    assert not os.path.exists(tmp_path / "bad")


def _fully_parallel(ckpt_dir: str) -> bool:
    parallel_state.initialize_model_parallel(1, 1)
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    big = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((256,), float(i)),
                                                    replica_id=parallel_state.get_data_parallel_rank())
           for i in range(8)}
    save(big, ckpt_dir, strategy)
    loaded = load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(256)) for k in big}, ckpt_dir)
    return all(torch.equal(loaded[k], big[k].data) for k in big)


def test_fully_parallel_save_spreads_writes(tmp_path):
    ckpt = tmp_path / "fp"
    assert all(run_on_ranks(WORLD, _fully_parallel, str(ckpt)))
    sizes = [os.path.getsize(ckpt / f"__{r}_0.distcp") for r in range(WORLD)]
    assert min(sizes) > 0.5 * max(sizes), sizes


def _async_save(ckpt_dir: str) -> bool:
    parallel_state.initialize_model_parallel(2, 1)
    sd = build_state_dict()
    expected = expected_state_dict()
    queue = AsyncCallsQueue()
    request = save(sd, ckpt_dir, async_sharded_save=True)
    assert not os.path.exists(ckpt_dir)
    queue.schedule_async_request(request)
    sd["col"].data.add_(1000.0)  # training goes on: the staged copy must not change
    queue.maybe_finalize_async_calls(blocking=True)
    assert queue.get_num_unfinalized_calls() == 0
    assert check_is_distributed_checkpoint(ckpt_dir)
    loaded = load(build_state_dict(empty=True), ckpt_dir)
    assert_same(loaded, expected)
    try:
        save(build_state_dict(), ckpt_dir)
    except CheckpointingException as e:
        assert "already holds a complete checkpoint" in str(e)
    else:
        raise AssertionError("saving over a complete checkpoint was not refused")
    save(build_state_dict(), ckpt_dir, overwrite=True)
    return True


def test_async_save_stages_and_finalizes(tmp_path):
    assert all(run_on_ranks(WORLD, _async_save, str(tmp_path / "async")))
    assert sorted(os.listdir(tmp_path)) == ["async"]
