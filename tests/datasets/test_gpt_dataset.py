"""GPTDataset, BlendedDataset and the builder return exactly megatron-core's samples; caching and config checks."""

from __future__ import annotations

import os
import warnings

import numpy
import pytest
import torch

from megatron_core.datasets import (
    BlendedDataset,
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    Split,
)
from megatron_core.datasets.gpt_masks import get_ltor_masks_and_position_ids
from megatron_core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_core.datasets.tokenizers import NullTokenizer
from tests.datasets.conftest import EOD, VOCAB

# (seed, sequence_length, blend names and weights | per-split blends, split, sizes, flags, extra options)
CASES = [
    (1, 16, (["a"], None), "90,7,3", [300, 50, 20], (False, False, False), {}),
    (7, 33, (["a", "b"], [0.3, 0.7]), "80,15,5", [300, 50, 20], (True, True, True), {}),
    (3, 8, (["a", "b", "c"], None), "50,50,0", [200, 40, None], (True, False, True), {}),
    (5, 24, (["b"], None), "70,20,10", [900, 130, 30], (False, True, False), {"add_extra_token_to_sequence": False}),
    (11, 12, (["a", "c"], [2.0, 1.0]), "60,30,10", [150, 400, 10], (False, False, True),
     {"drop_last_partial_validation_sequence": False, "create_attention_mask": False}),
    (2, 20, [(["a"], None), (["b", "c"], [0.5, 0.5]), (["c", "a"], None)], None, [100, 60, 30], (True, True, False), {}),
    (9, 10, (["a"], [1.0]), "1", [2000, 10, 10], (False, False, False), {}),
    (4, 14, [(["a", "b"], [0.6, 0.4]), (["b", "c"], None), (["c"], None)], None, [120, None, 20],
     (False, True, True), {"multiple_validation_sets": True, "num_dataset_builder_threads": 2}),
    (6, 9, (["z", "c"], [0.5, 0.5]), "70,20,10", [200, 40, 20], (True, True, True), {}),
]


def _config_kwargs(corpora, case) -> dict:
    seed, sequence_length, blend, split, _, flags, extra = case
    kwargs = dict(
        random_seed=seed,
        sequence_length=sequence_length,
        split=split,
        reset_position_ids=flags[0],
        reset_attention_mask=flags[1],
        eod_mask_loss=flags[2],
        tokenizer=NullTokenizer(VOCAB),
        **extra,
    )
    if isinstance(blend, list):
        kwargs["blend_per_split"] = [([corpora[name] for name in names], weights) for names, weights in blend]
    else:
        kwargs["blend"] = ([corpora[name] for name in blend[0]], blend[1])
    return kwargs


def _assert_same(ours, theirs, indices=None) -> int:
    """Same class, length and sample dicts (every index, or ``indices``); returns how many were compared."""
    assert type(ours).__name__ == type(theirs).__name__
    assert len(ours) == len(theirs)
    indices = range(len(theirs)) if indices is None else indices
    for index in indices:
        a, b = ours[index], theirs[index]
        assert list(a) == list(b), index
        for key in b:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (index, key)
    return len(indices)


def _assert_same_indices(ours, theirs) -> None:
    for name in ("document_index", "sample_index", "shuffle_index"):
        mine, ref = getattr(ours, name), getattr(theirs, name)
        assert mine.dtype == ref.dtype and numpy.array_equal(mine, ref), name


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_builder_matches_megatron(corpora, tmp_path, mcore, case):
    from megatron.core.datasets import blended_megatron_dataset_builder as reference_builder
    from megatron.core.datasets import gpt_dataset as reference_gpt

    kwargs = _config_kwargs(corpora, case)
    sizes = case[4]
    ours = BlendedMegatronDatasetBuilder(
        GPTDataset, sizes, lambda: True, GPTDatasetConfig(path_to_cache=str(tmp_path / "ours"), **kwargs)
    ).build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference_builder.BlendedMegatronDatasetBuilder(
            reference_gpt.GPTDataset, sizes, lambda: True, reference_gpt.GPTDatasetConfig(**kwargs)
        ).build()
    checked = 0
    for split in Split:
        if theirs[split.value] is None:
            assert ours[split.value] is None
            continue
        mine, ref = ours[split.value], theirs[split.value]
        pairs = list(zip(mine, ref, strict=True)) if isinstance(ref, list) else [(mine, ref)]
        for mine, ref in pairs:
            checked += _assert_same(mine, ref)
            if isinstance(mine, GPTDataset):
                _assert_same_indices(mine, ref)
    assert checked > 0


def test_mock_dataset_matches_megatron(mcore):
    """The mock corpus holds ~10^6 samples per split: the full index arrays are compared, samples at 97 points."""
    from megatron.core.datasets import blended_megatron_dataset_builder as reference_builder
    from megatron.core.datasets import gpt_dataset as reference_gpt

    kwargs = dict(
        random_seed=4, sequence_length=64, reset_position_ids=True, reset_attention_mask=False,
        eod_mask_loss=True, tokenizer=NullTokenizer(VOCAB),
    )
    sizes = [40, 8, 8]
    ours = BlendedMegatronDatasetBuilder(MockGPTDataset, sizes, lambda: True, GPTDatasetConfig(**kwargs)).build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference_builder.BlendedMegatronDatasetBuilder(
            reference_gpt.MockGPTDataset, sizes, lambda: True, reference_gpt.GPTDatasetConfig(**kwargs)
        ).build()
    for mine, ref in zip(ours, theirs):
        _assert_same_indices(mine, ref)
        _assert_same(mine, ref, numpy.linspace(0, len(ref) - 1, 97).astype(int).tolist())


def _loop_reference(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """A plain per-EOD loop written from the definition (mask True = masked)."""
    n = data.numel()
    visible = torch.ones(n, n).tril()
    loss = torch.ones(n)
    positions = torch.arange(n)
    if eod_mask_loss:
        loss[data == eod] = 0
    start = 0
    for i in range(n):
        if data[i] == eod:
            if reset_attention_mask:
                visible[i + 1 :, : i + 1] = 0
            if reset_position_ids:
                positions[i + 1 :] = torch.arange(n - i - 1)
            start = i + 1
    del start
    return visible.unsqueeze(0) < 0.5, loss, positions


@pytest.mark.parametrize("flags", [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)])
def test_masks_match_loop_reference(flags):
    generator = torch.Generator().manual_seed(sum(flags))
    data = torch.randint(0, 6, (40,), generator=generator)
    data[[0, 7, 8, 39]] = 5
    ours = get_ltor_masks_and_position_ids(data, 5, *flags, True)
    ref = _loop_reference(data, 5, *flags)
    for mine, expected in zip(ours, ref):
        assert torch.equal(mine, expected)
    assert get_ltor_masks_and_position_ids(data, 5, *flags, False)[0] is None


def test_cache_written_once_and_reused(corpora, tmp_path):
    kwargs = _config_kwargs(corpora, CASES[1])
    cache = tmp_path / "cache"
    config = GPTDatasetConfig(path_to_cache=str(cache), **kwargs)
    first = BlendedMegatronDatasetBuilder(GPTDataset, [300, 50, 20], lambda: True, config).build()
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith("description.txt")]) == 3 * 2 + 3  # 2 GPT x 3 splits + 3 blends
    assert not [f for f in files if f.startswith(".tmp")]
    stamps = {f: os.stat(cache / f).st_mtime_ns for f in files}
    second = BlendedMegatronDatasetBuilder(GPTDataset, [300, 50, 20], lambda: True, config).build()
    assert {f: os.stat(cache / f).st_mtime_ns for f in os.listdir(cache)} == stamps
    assert isinstance(second[0], BlendedDataset)
    assert isinstance(second[0].datasets[0].sample_index, numpy.memmap)
    for index in range(0, len(first[0]), 7):
        assert all(torch.equal(torch.as_tensor(first[0][index][k]), torch.as_tensor(second[0][index][k]))
                   for k in first[0][index])
    other = GPTDatasetConfig(path_to_cache=str(cache), **{**kwargs, "random_seed": 8})
    BlendedMegatronDatasetBuilder(GPTDataset, [300, 50, 20], lambda: True, other).build()
    assert len(os.listdir(cache)) == 2 * len(files)


def test_default_cache_location_and_padding_sample(corpora):
    config = GPTDatasetConfig(**_config_kwargs(corpora, CASES[0]))
    train = BlendedMegatronDatasetBuilder(GPTDataset, [30, None, None], lambda: True, config).build()[0]
    assert os.path.isdir(os.path.join(corpora["a"], "cache", "GPTDataset_indices"))
    sample = train[None]
    assert sample["loss_mask"].sum() == 0 and sample["tokens"].shape == (16,)
    assert int(train[0]["tokens"].max()) <= EOD


def test_zero_length_sequences_raise_instead_of_spinning(tmp_path):
    prefix = str(tmp_path / "empty")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for _ in range(5):
        builder.add_item(torch.tensor([], dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    config = GPTDatasetConfig(**{**_config_kwargs({"a": prefix}, CASES[0]), "split": "1"})
    with pytest.raises(ValueError, match="train: the split has no tokens, but 4 samples were requested"):
        BlendedMegatronDatasetBuilder(GPTDataset, [4, None, None], lambda: True, config).build()


def test_config_validation(corpora):
    base = _config_kwargs(corpora, CASES[0])
    with pytest.raises(ValueError, match="eod_mask_loss"):
        GPTDatasetConfig(**{**base, "eod_mask_loss": None})
    with pytest.raises(ValueError, match="split must be provided"):
        GPTDatasetConfig(**{**base, "split": None})
    with pytest.raises(ValueError, match="2 prefixes but 1 weights"):
        GPTDatasetConfig(**{**base, "blend": ([corpora["a"], corpora["b"]], [1.0])})
    with pytest.raises(ValueError, match="incompatible"):
        GPTDatasetConfig(**{**base, "blend_per_split": [([corpora["a"]], None), None, None]})
    with pytest.raises(ValueError, match="tokenizer"):
        GPTDatasetConfig(**{**base, "tokenizer": None})
    weighted = GPTDatasetConfig(**{**base, "blend": ([corpora["a"], corpora["b"]], [1.0, 2.0])})
    with pytest.raises(ValueError, match="size None"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, None, 5], lambda: True, weighted)
    mock = GPTDatasetConfig(**{**base, "blend": None, "split": None})
    assert mock.mock and mock.split == "1,1,1" and mock.token_dtype_code == 8
    missing = GPTDatasetConfig(**{**base, "blend": ([corpora["a"], corpora["a"] + "-gone"], None)})
    with pytest.raises(FileNotFoundError, match=r"1 blend prefix\(es\) not found.*a-gone \(missing .*a-gone\.idx"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 5], lambda: True, missing)
    empty_test_split = GPTDatasetConfig(**{**base, "split": "99,1,0.001"})
    with pytest.raises(ValueError, match="no tokens"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 5], lambda: True, empty_test_split).build()
