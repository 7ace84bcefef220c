"""``MultimodalDatasetConfig`` / ``MockMultimodalDataset`` against megatron-core's, and the builder's type names."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from megatron_core.datasets import BlendedDataset, BlendedMegatronDatasetBuilder, MegatronDataset
from megatron_core.datasets.blended_megatron_dataset_builder import (
    DistributedDataset,
    MidLevelDataset,
    TopLevelDataset,
)
from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.multimodal_dataset import MockMultimodalDataset, MultimodalDatasetConfig
from megatron_core.datasets.tokenizers import NullTokenizer
from tests.datasets.conftest import VOCAB

KWARGS = dict(random_seed=3, sequence_length=16, reset_position_ids=False, reset_attention_mask=False,
              eod_mask_loss=False, image_h=6, image_w=5)


def _add_flag(sample: dict) -> dict:
    sample["flag"] = torch.ones(1)
    return sample


def test_config_requires_image_size():
    with pytest.raises(ValueError, match="image_h, image_w must be set"):
        MultimodalDatasetConfig(random_seed=1, sequence_length=8, reset_position_ids=False,
                                reset_attention_mask=False, eod_mask_loss=False, tokenizer=NullTokenizer(VOCAB))


def test_samples_hold_text_and_a_blank_image():
    config = MultimodalDatasetConfig(tokenizer=NullTokenizer(VOCAB), preprocess_func=_add_flag, **KWARGS)
    train, _, _ = BlendedMegatronDatasetBuilder(MockMultimodalDataset, [12, 4, 4], lambda: True, config).build()
    sample = train[3]
    assert sample["image"].shape == (3, 6, 5) and sample["image"].dtype == torch.float32
    assert not sample["image"].any() and torch.equal(sample["flag"], torch.ones(1))
    assert sample["tokens"].shape == (16,)


def test_matches_megatron(mcore):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = importlib.import_module("megatron.core.datasets.multimodal_dataset")
        reference_builder = importlib.import_module("megatron.core.datasets.blended_megatron_dataset_builder")
    ours = BlendedMegatronDatasetBuilder(
        MockMultimodalDataset, [12, 4, 4], lambda: True,
        MultimodalDatasetConfig(tokenizer=NullTokenizer(VOCAB), **KWARGS)).build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference_builder.BlendedMegatronDatasetBuilder(
            reference.MockMultimodalDataset, [12, 4, 4], lambda: True,
            reference.MultimodalDatasetConfig(tokenizer=NullTokenizer(VOCAB), **KWARGS)).build()
    for mine, ref in zip(ours, theirs):
        assert len(mine) == len(ref)
        for i in (0, 1, len(ref) - 1):
            a, b = mine[i], ref[i]
            assert sorted(a) == sorted(b)
            for key in a:
                assert torch.equal(a[key], b[key]), key


def test_builder_type_names():
    assert MidLevelDataset is MegatronDataset
    assert set(TopLevelDataset.__args__) == {BlendedDataset, MegatronDataset}
    assert {BlendedDataset, MegatronDataset, IndexedDataset, torch.utils.data.Dataset} <= set(DistributedDataset.__args__)
