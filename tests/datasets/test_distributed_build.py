"""Building on 2 ranks: rank 0 writes the cached indices once, rank 1 loads them; both see the same samples."""

from __future__ import annotations

import os

import torch

from megatron_core.datasets import BlendedDataset, BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig
from megatron_core.datasets.tokenizers import NullTokenizer
from tests.datasets.conftest import VOCAB
from tests.dist_harness import run_on_ranks


def _build_on_ranks(prefixes: list[str], cache: str) -> dict:
    rank = torch.distributed.get_rank()
    config = GPTDatasetConfig(
        random_seed=3, sequence_length=12, blend=(prefixes, [0.4, 0.6]), split="8,1,1", path_to_cache=cache,
        reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True, tokenizer=NullTokenizer(VOCAB),
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, 10], lambda: True, config).build()
    assert isinstance(train, BlendedDataset)
    stacked = {key: torch.stack([torch.as_tensor(train[i][key]) for i in range(len(train))]) for key in train[0]}
    skipped = BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, 10], lambda: rank == 0, config).build()
    return {"train": stacked, "valid_tokens": torch.stack([torch.as_tensor(s["tokens"]) for s in valid]),
            "skipped_is_none": [dataset is None for dataset in skipped]}


def test_rank_zero_builds_cache_once_and_ranks_agree(corpora, tmp_path):
    cache = str(tmp_path / "cache")
    results = run_on_ranks(2, _build_on_ranks, [corpora["a"], corpora["b"]], cache)
    for key, value in results[0]["train"].items():
        assert torch.equal(value, results[1]["train"][key]), key
    assert torch.equal(results[0]["valid_tokens"], results[1]["valid_tokens"])
    assert results[0]["skipped_is_none"] == [False, False, False]
    assert results[1]["skipped_is_none"] == [True, True, True]
    files = os.listdir(cache)
    assert len([f for f in files if f.endswith("description.txt")]) == 2 * 3 + 3  # one set, no duplicates
    assert not [f for f in files if f.startswith(".tmp")]
