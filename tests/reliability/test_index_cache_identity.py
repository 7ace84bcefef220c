"""The dataset index cache belongs to the data files it was built from.

Data regenerated at the same prefix used to reuse the old cached indices (samples no longer
matching the documents); now the cache records the ``.bin``/``.idx`` sizes, modification times
and the ``.idx`` SHA-256, is rebuilt when they change, and a warning says so. A cached ``.npy``
that fails to load raises naming its path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from megatron_core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_core.datasets.tokenizers import NullTokenizer
from tests.datasets.conftest import VOCAB, write_corpus


def _train(prefix: str, cache: Path) -> GPTDataset:
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, split="100,0,0", blend=([prefix], None),
                              tokenizer=NullTokenizer(VOCAB), path_to_cache=str(cache), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, [40, None, None], lambda: True, config).build()[0]


def _tokens(dataset: GPTDataset) -> list[torch.Tensor]:
    return [torch.as_tensor(dataset[i]["tokens"]) for i in range(len(dataset))]


def test_regenerated_data_rebuilds_the_cache_and_says_so(tmp_path: Path, caplog) -> None:
    prefix, cache = str(tmp_path / "corpus"), tmp_path / "cache"
    write_corpus(prefix, 30, seed=1, max_length=20)
    _train(prefix, cache)
    write_corpus(prefix, 12, seed=2, max_length=6)  # other documents at the same prefix
    with caplog.at_level(logging.WARNING):
        rebuilt = _train(prefix, cache)
    assert any("data files changed" in r.getMessage() and "idx_sha256" in r.getMessage() for r in caplog.records)
    fresh = _train(prefix, tmp_path / "fresh_cache")
    assert all(torch.equal(a, b) for a, b in zip(_tokens(rebuilt), _tokens(fresh)))
    assert all(t.numel() == 8 for t in _tokens(rebuilt))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _train(prefix, cache)  # unchanged data: the cache is reused quietly
    assert not [r for r in caplog.records if "Rebuilding" in r.getMessage()]


def test_unloadable_cached_array_names_its_path(tmp_path: Path) -> None:
    prefix, cache = str(tmp_path / "corpus"), tmp_path / "cache"
    write_corpus(prefix, 30, seed=1, max_length=20)
    _train(prefix, cache)
    broken = next(p for p in sorted(cache.iterdir()) if p.name.endswith("GPTDataset-train-sample_index.npy"))
    broken.write_bytes(b"not an npy file")
    with pytest.raises(ValueError, match=str(broken).replace(".", r"\.")):
        _train(prefix, cache)
    assert os.path.exists(broken)
