"""Pretraining samplers: DP sharding, resumption from consumed_samples, the DataLoader builder."""

from __future__ import annotations

import pytest
import torch

from megatron_core.datasets import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)

TOTAL, MBS, DP = 50, 3, 2  # global micro-batch of 6; 50 = 8 * 6 + 2


def _batches(sampler) -> list[list[int]]:
    return list(iter(sampler))


@pytest.mark.parametrize("drop_last", [True, False])
def test_sequential_sampler_shards_and_resumes(drop_last):
    per_rank = [_batches(MegatronPretrainingSampler(TOTAL, 0, MBS, rank, DP, drop_last)) for rank in range(DP)]
    full_steps = TOTAL // (MBS * DP)
    assert len(per_rank[0]) == full_steps + (0 if drop_last else 1)
    for step in range(full_steps):
        assert per_rank[0][step] + per_rank[1][step] == list(range(step * 6, step * 6 + 6))
    if not drop_last:
        assert per_rank[0][-1] == [48, 49] and per_rank[1][-1] == []
    for consumed_steps in (1, 5):
        for rank in range(DP):
            resumed = _batches(MegatronPretrainingSampler(TOTAL, consumed_steps * 6, MBS, rank, DP, drop_last))
            assert resumed == per_rank[rank][consumed_steps:]
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(TOTAL, TOTAL, MBS, 0, DP)
    with pytest.raises(ValueError, match=r"data_parallel_rank \(2\)"):
        MegatronPretrainingSampler(TOTAL, 0, MBS, 2, DP)


@pytest.mark.parametrize("data_sharding", [True, False])
def test_random_sampler_shards_and_resumes(data_sharding):
    def epoch(consumed: int, rank: int) -> list[list[int]]:
        return _batches(MegatronPretrainingRandomSampler(None, TOTAL, consumed, MBS, rank, DP, data_sharding))

    first = [epoch(0, rank) for rank in range(DP)]
    assert all(len(batches) == 8 and all(len(b) == MBS for b in batches) for batches in first)
    seen = sorted(index for batches in first for batch in batches for index in batch)
    assert len(seen) == len(set(seen)) == 48 and seen[-1] < 48  # disjoint ranks, the partial batch dropped
    assert seen != [index for batch in first[0] + first[1] for index in batch]  # shuffled
    for rank in range(DP):
        assert epoch(3 * 6, rank) == first[rank][3:]
        second_epoch = epoch(48, rank)
        assert len(second_epoch) == 8 and second_epoch != first[rank]
        assert epoch(48 + 2 * 6, rank) == second_epoch[2:]
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        epoch(4, 0)


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor(index * index)}


def test_data_loader_builder():
    loader = build_pretraining_data_loader(_Squares(), 8, 2, data_parallel_rank=1, data_parallel_size=2)
    values = [batch["x"].tolist() for batch in loader]
    assert values == [[100, 121], [196, 225], [324, 361]]  # samples 8-19, rank 1 takes [2:4) of each 4
    cyclic = build_pretraining_data_loader(_Squares(), 0, 2, 0, 2, dataloader_type="cyclic")
    assert len(list(cyclic)) == 5
    assert build_pretraining_data_loader(None, 0, 2) is None
    with pytest.raises(ValueError, match="dataloader_type 'x'"):
        build_pretraining_data_loader(_Squares(), 0, 2, 0, 1, dataloader_type="x")
