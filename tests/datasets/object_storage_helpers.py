"""Shared checks for the object-storage dataset tests: compare a remote ``IndexedDataset`` and the
datasets the builder makes on it with the same files read locally."""

from __future__ import annotations

import numpy
import torch

from megatron_core.datasets import BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, Split
from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.tokenizers import NullTokenizer
from tests.datasets.conftest import VOCAB


def assert_same_indexed(remote: IndexedDataset, local: IndexedDataset) -> int:
    """Every sequence, a few slices and offset reads agree; returns the number of sequences compared."""
    assert len(remote) == len(local)
    assert numpy.array_equal(remote.sequence_lengths, local.sequence_lengths)
    assert numpy.array_equal(remote.document_indices, local.document_indices)
    for i in range(len(local)):
        assert numpy.array_equal(remote[i], local[i]), i
    for start, stop in ((0, 5), (17, 40), (len(local) - 3, len(local))):
        for mine, ref in zip(remote[start:stop], local[start:stop], strict=True):
            assert numpy.array_equal(mine, ref), (start, stop)
    for i in (1, len(local) // 2):
        length = int(local.sequence_lengths[i])
        assert numpy.array_equal(remote.get(i, offset=1, length=length - 1), local.get(i, offset=1, length=length - 1))
    return len(local)


def gpt_config(prefixes: list[str], **extra) -> GPTDatasetConfig:
    """A small GPT blend over ``prefixes`` (same seed and options for the remote and local runs)."""
    return GPTDatasetConfig(
        random_seed=5, sequence_length=16, blend=(prefixes, [0.6, 0.4][: len(prefixes)] if len(prefixes) > 1 else None),
        split="80,15,5", reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
        tokenizer=NullTokenizer(VOCAB), **extra,
    )


def build_splits(config: GPTDatasetConfig, sizes: list[int]) -> list:
    """``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` on every split."""
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def assert_same_splits(remote: list, local: list) -> int:
    """Same samples in every split; returns how many samples were compared."""
    compared = 0
    for split in Split:
        mine, ref = remote[split.value], local[split.value]
        assert (mine is None) == (ref is None), split
        if ref is None:
            continue
        assert len(mine) == len(ref) and len(ref) > 0, split
        for i in range(len(ref)):
            a, b = mine[i], ref[i]
            assert list(a) == list(b)
            for key in b:
                assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (split, i, key)
            compared += 1
    return compared
