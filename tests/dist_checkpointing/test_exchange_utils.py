"""``dist_checkpointing.exchange_utils`` and the fully parallel wrappers built on it.

The assignment rule is compared with megatron-core's on random inputs; the distribution, the three exchange
algorithms and ``distribute_main_replicas_with_precomputed_distribution`` run on 4 gloo ranks against what
each rank should hold; the fully parallel load with every ``exchange_algo`` equals a plain load.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.dist_checkpointing import load, save
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.exchange_utils import (
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
    is_float8tensor,
)
from megatron_core.dist_checkpointing.mapping import ShardedTensor
from megatron_core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_main_replicas_with_precomputed_distribution,
)
from megatron_core.dist_checkpointing.strategies.torch_dist import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron_core.dist_checkpointing.utils import _sharded_tensor_shard_id
from tests.dist_checkpointing.sharded_fixtures import assert_same, build_state_dict, expected_state_dict
from tests.dist_harness import run_on_ranks

WORLD = 4


def _random_problem(seed: int) -> tuple:
    rng = random.Random(seed)
    shards = [(f"k{i}", (rng.randrange(3) * 4,), None) for i in range(12)]
    shards = list(dict.fromkeys(shards))
    to_ranks = {s: sorted(rng.sample(range(WORLD), rng.randint(1, WORLD))) for s in shards}
    sizes = {s: rng.choice([8, 16, 16, 64]) for s in shards}
    cross = {s for s in shards if rng.random() < 0.3}
    return to_ranks, sizes, cross


@pytest.mark.parametrize("seed", range(5))
def test_assignment_rule_matches_megatron(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = pytest.importorskip("megatron.core.dist_checkpointing.exchange_utils")
    to_ranks, sizes, cross = _random_problem(seed)
    ours = distribute_shards_to_ranks(to_ranks, sizes, WORLD, cross)
    assert ours == reference.distribute_shards_to_ranks(to_ranks, sizes, WORLD, cross)
    assert all(ours[s] in to_ranks[s] for s in to_ranks)


def _state(rank: int) -> dict:
    """Shards ``a`` (everyone, main on rank 0), ``b`` (ranks 0-1, main on 1), ``c`` (rank 3 only, bf16, 2-D),
    ``d`` (ranks 2-3, main replica on none of them)."""
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.arange(6.0), replica_id=rank)}
    if rank < 2:
        sd["b"] = ShardedTensor.from_rank_offsets("b", torch.full((3,), 7.0), replica_id=1 - rank)
    if rank == 3:
        sd["c"] = ShardedTensor.from_rank_offsets("c", torch.ones(2, 5, dtype=torch.bfloat16))
    if rank >= 2:
        sd["d"] = ShardedTensor.from_rank_offsets("d", torch.full((4,), 3.0, dtype=torch.bfloat16),
                                                  replica_id=rank)
    return sd


def _distribution(ignore_groups: bool) -> tuple:
    rank = dist.get_rank()
    distribution = determine_main_replica_uniform_distribution(_state(rank), None, ignore_groups)
    owners = {sid[0]: owner for sid, owner in distribution.main_rank_for_shard.items()}
    holders = {sid[0]: ranks for sid, ranks in distribution.all_ranks_for_shard.items()}
    sd = _state(rank)
    distribute_main_replicas_with_precomputed_distribution(sd, None, distribution)
    mains = sorted(k for k, sh in sd.items() if sh.replica_id == 0)
    return owners, holders, mains


@pytest.mark.parametrize("ignore_groups", [False, True])
def test_distribution_and_main_replicas(ignore_groups):
    results = run_on_ranks(WORLD, _distribution, ignore_groups)
    owners, holders, _ = results[0]
    assert all(r[0] == owners and r[1] == holders for r in results)
    expected_keys = {"a", "b", "c", "d"} if ignore_groups else {"a", "b", "c"}
    assert set(owners) == expected_keys
    assert holders["a"] == [0, 1, 2, 3] and holders["b"] == [0, 1] and holders["c"] == [3]
    assert owners["c"] == 3 and all(owners[k] in holders[k] for k in owners)
    mains = [r[2] for r in results]
    for key in expected_keys:  # exactly one main replica per distributed shard
        assert sum(key in m for m in mains) == 1, (key, mains)
    assert not any("d" in m for m in mains) or ignore_groups


def _exchange(algo: str) -> dict:
    rank = dist.get_rank()
    sd = _state(rank)
    distribution = determine_main_replica_uniform_distribution(sd, None, True)
    loaded, unloaded = {}, {}
    for sh in sd.values():
        sid = _sharded_tensor_shard_id(sh)
        if distribution.main_rank_for_shard[sid] == rank:
            loaded[sid] = sh.data.clone()
        else:
            unloaded[sid] = ShardedTensor.from_rank_offsets(sh.key, torch.zeros_like(sh.data))
    result = exchange_by_distribution(loaded, unloaded, distribution, None, algo)
    expected = {_sharded_tensor_shard_id(sh): sh.data for sh in sd.values()}
    return {sid[0]: bool(torch.equal(result[sid], t) and result[sid].dtype == t.dtype)
            for sid, t in expected.items()}


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds", "gather_object"])
def test_exchange_gives_every_rank_its_shards(algo):
    for rank, got in enumerate(run_on_ranks(WORLD, _exchange, algo)):
        assert got and all(got.values()), (rank, got)


def _lacking_owner() -> str:
    sd = _state(dist.get_rank())
    distribution = determine_main_replica_uniform_distribution(sd, None, True)
    with pytest.raises(CheckpointingException, match="owning rank holds no data") as info:
        exchange_by_distribution({}, {}, distribution, None, "broadcast")
    return str(info.value)


def test_exchange_refuses_when_the_owner_has_no_data():
    run_on_ranks(WORLD, _lacking_owner)


def _duplicate_objects() -> bool:
    with pytest.raises(CheckpointingException, match="Duplicate shard ids"):
        exchange_loaded_objects_gather_object({("o", (0,), (1,)): dist.get_rank()})
    return True


def test_object_gather_refuses_duplicates():
    assert all(run_on_ranks(WORLD, _duplicate_objects))


def test_exchange_refuses_unknown_algo_and_plain_tensors_are_not_fp8():
    with pytest.raises(NotImplementedError, match="exchange_algo='p2p'"):
        exchange_by_distribution({}, {}, object(), None, "p2p")
    with pytest.raises(ValueError, match="exchange_algo='p2p' must be one of"):
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo="p2p")
    assert not is_float8tensor(torch.ones(2))
    assert determine_main_replica_uniform_distribution({}, None) is None  # no process group: one rank


class _CountingLoad(TorchDistLoadShardedStrategy):
    read = 0

    def load(self, sharded_state_dict, checkpoint_dir):
        from megatron_core.dist_checkpointing.dict_utils import nested_values

        _CountingLoad.read += sum(isinstance(x, ShardedTensor) for x in nested_values(sharded_state_dict))
        return super().load(sharded_state_dict, checkpoint_dir)


def _fully_parallel_roundtrip(ckpt_dir: str, algo: str) -> tuple:
    parallel_state.initialize_model_parallel(2, 1)  # TP=2 x DP=2
    dp = parallel_state.get_data_parallel_group()
    saver = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), dp, do_cache_distribution=True)
    save(build_state_dict(), ckpt_dir, saver)
    first = saver.cached_distribution
    _CountingLoad.read = 0
    loader = FullyParallelLoadStrategyWrapper(_CountingLoad(), dp, exchange_algo=algo)
    loaded = load(build_state_dict(empty=True), ckpt_dir, loader)
    assert_same(loaded, expected_state_dict())
    return first is not None, _CountingLoad.read


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds", "gather_object"])
def test_fully_parallel_save_and_load_with_every_algo(tmp_path, algo):
    results = run_on_ranks(WORLD, _fully_parallel_roundtrip, str(tmp_path / "ckpt"), algo)
    assert all(cached for cached, _ in results)
    reads = [n for _, n in results]
    assert reads[0] + reads[2] == reads[1] + reads[3]  # DP pairs (0, 2) and (1, 3) split the same shards
