"""BERT and T5 masked WordPiece datasets: megatron-core's samples exactly, masking statistics, structure, errors."""

from __future__ import annotations

import os
import warnings

import numpy
import pytest
import torch

from megatron_core.datasets import BlendedMegatronDatasetBuilder
from megatron_core.datasets import distributed as dataset_distributed
from megatron_core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron_core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron_core.datasets.tokenizers import NullTokenizer
from tests.datasets.wordpiece_toy import (
    FIRST_PIECE,
    FIRST_SENTINEL,
    ToyWordPieceTokenizer,
    write_sentence_corpus,
)
from tests.dist_harness import run_on_ranks

TOKENIZER = ToyWordPieceTokenizer()
MASK, CLS, SEP, BOS, EOS = TOKENIZER.mask, TOKENIZER.cls, TOKENIZER.sep, TOKENIZER.bos, TOKENIZER.eos


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> dict[str, str]:
    """Two sentence-level corpora (120 documents each, some with a 600-token sentence)."""
    directory = tmp_path_factory.mktemp("sentences")
    prefixes = {name: str(directory / name) for name in ("a", "b")}
    for seed, prefix in enumerate(prefixes.values(), start=1):
        write_sentence_corpus(prefix, 120, seed, long_sentence_every=17)
    return prefixes


def _kwargs(sentences, blend=(["a"], None), **overrides) -> dict:
    kwargs = dict(
        random_seed=1234, sequence_length=64, blend=([sentences[name] for name in blend[0]], blend[1]),
        split="80,10,10", tokenizer=TOKENIZER, masking_probability=0.15, short_sequence_probability=0.1,
        masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
    )
    kwargs.update(overrides)
    return kwargs


def _build(cls, config_cls, sizes, **kwargs):
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config_cls(**kwargs)).build()


# (dataset, blend, sizes, config overrides); Megatron needs a size for every split (its C++ takes no None).
CASES = [
    ("bert", (["a"], None), [300, 30, 30], dict(classification_head=True)),
    ("bert", (["a", "b"], [0.4, 0.6]), [300, 30, 30],
     dict(classification_head=False, masking_do_full_word=False, masking_use_longer_ngrams=True, random_seed=7)),
    ("bert", (["a"], None), [200, 30, 30],
     dict(classification_head=True, masking_do_permutation=True, masking_max_ngram=4, short_sequence_probability=0.5)),
    ("bert", (["b"], None), [200, 30, 30],
     dict(classification_head=False, masking_use_geometric_distribution=True, sequence_length=20)),
    ("t5", (["a"], None), [300, 30, 30], dict(sequence_length_decoder=32)),
    ("t5", (["a", "b"], [1.0, 2.0]), [300, 30, 30],
     dict(sequence_length_decoder=40, masking_use_geometric_distribution=True, masking_max_ngram=10, sequence_length=80)),
    ("t5", (["b"], None), [100, 30, 30],
     dict(sequence_length_decoder=40, masking_do_permutation=True, masking_do_full_word=False)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{case[0]}{i}" for i, case in enumerate(CASES)])
def test_every_sample_matches_megatron(sentences, tmp_path, mcore, monkeypatch, case):
    from megatron.core.datasets import bert_dataset, t5_dataset
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder as Reference,
    )

    kind, blend, sizes, overrides = case
    kwargs = _kwargs(sentences, blend, **overrides)
    if kind == "bert":
        ours_cls, ours_config, ref_cls, ref_config = (BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig,
                                                      bert_dataset.BERTMaskedWordPieceDataset,
                                                      bert_dataset.BERTMaskedWordPieceDatasetConfig)
    else:
        ours_cls, ours_config, ref_cls, ref_config = (T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig,
                                                      t5_dataset.T5MaskedWordPieceDataset,
                                                      t5_dataset.T5MaskedWordPieceDatasetConfig)
    ours = _build(ours_cls, ours_config, sizes, path_to_cache=str(tmp_path / "ours"), **kwargs)
    # Megatron's masked datasets ask torch.distributed for the rank even without a process group.
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kw: 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = Reference(ref_cls, sizes, lambda: True, ref_config(path_to_cache=str(tmp_path / "ref"), **kwargs)).build()
    compared = 0
    for mine, ref in zip(ours, theirs, strict=True):
        assert len(mine) == len(ref)
        for index in range(len(ref)):
            # The permutation option draws N-gram lengths from numpy's global RNG (in Megatron too).
            numpy.random.seed(index)
            a = mine[index]
            numpy.random.seed(index)
            b = ref[index]
            assert list(a) == list(b)
            for key, value in b.items():
                assert type(a[key]) is type(value), (index, key)
                if isinstance(value, numpy.ndarray):
                    assert a[key].dtype == value.dtype, (index, key)
                numpy.testing.assert_array_equal(a[key], value, err_msg=f"sample {index}, {key}")
            compared += 1
    assert compared >= 200


def _original_tokens(sample) -> numpy.ndarray:
    """The BERT text before masking (no permutation): labels where the loss mask is set."""
    return numpy.where(sample["loss_mask"] == 1, sample["labels"], sample["text"])


def test_bert_masking_statistics_and_invariants(sentences, tmp_path):
    train = _build(BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig, [600, None, None],
                   path_to_cache=str(tmp_path), **_kwargs(sentences, classification_head=True,
                                                          short_sequence_probability=0.0, masking_max_ngram=1))[0]
    masked = kept = replaced = tokens = random_pairs = 0
    for index in range(600):
        sample = train[index]
        original = _original_tokens(sample)
        # (A random replacement may be any id, [PAD] included, so padding_mask cannot give the length.)
        separators = numpy.flatnonzero(original == SEP)
        length = int(separators[-1]) + 1
        where = sample["loss_mask"] == 1
        masked += int(where.sum())
        tokens += length
        replaced += int((sample["text"][where] == MASK).sum())
        kept += int((sample["text"][where] == original[where]).sum())
        random_pairs += sample["is_random"]
        # Never CLS, SEP or padding; -1 labels and zero loss elsewhere.
        assert not numpy.isin(original[where], [CLS, SEP]).any() and where[:length].sum() == where.sum()
        assert (sample["labels"][~where] == -1).all()
        # Whole words: a ## piece after a word token is masked exactly when that token is.
        pieces = numpy.flatnonzero(original[1:length] >= FIRST_PIECE) + 1
        follows_word = ~numpy.isin(original[pieces - 1], [CLS, SEP])
        assert (where[pieces[follows_word]] == where[pieces[follows_word] - 1]).all()
        # [CLS] A [SEP] B [SEP], types 0 then 1, padding 0 (the pad id) everywhere after.
        assert original[0] == CLS and len(separators) == 2
        assert (sample["types"][: separators[0] + 1] == 0).all() and (sample["types"][separators[0] + 1 : length] == 1).all()
        assert (sample["text"][length:] == 0).all() and (sample["padding_mask"][length:] == 0).all()
    # About 15% of the tokens (fewer where whole words overshoot the budget), 80% [MASK], 10% random, 10% kept.
    assert 0.13 < masked / tokens <= 0.15
    assert abs(replaced / masked - 0.8) < 0.03
    assert abs(kept / masked - 0.1) < 0.03
    assert 0.4 < random_pairs / 600 < 0.6


def test_bert_pairs_are_the_sample_sentences_in_either_order(sentences, tmp_path):
    train = _build(BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig, [200, None, None],
                   path_to_cache=str(tmp_path), **_kwargs(sentences, classification_head=True, sequence_length=512,
                                                          short_sequence_probability=0.0))[0]
    for index in range(200):
        sample = train[index]
        assert sample["truncated"] == 0
        first, end, _ = (int(value) for value in train.sample_index[index])
        parts = [train.dataset[i].tolist() for i in range(first, end)]
        original = _original_tokens(sample).tolist()
        separator = original.index(SEP)
        segment_a, segment_b = original[1:separator], original[separator + 1 : original.index(SEP, separator + 1)]
        halves = [(sum(parts[:pivot], []), sum(parts[pivot:], [])) for pivot in range(1, len(parts))]
        expected = (segment_a, segment_b) if sample["is_random"] == 0 else (segment_b, segment_a)
        assert expected in halves


def test_t5_sentinel_structure(sentences, tmp_path):
    train = _build(T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig, [300, None, None],
                   path_to_cache=str(tmp_path), **_kwargs(sentences, sequence_length_decoder=48,
                                                          masking_use_geometric_distribution=True, masking_max_ngram=5))[0]
    masked = total = spans_longer_than_one = 0
    for index in range(300):
        sample = train[index]
        first, end, target = (int(value) for value in train.sample_index[index])
        original = sum((train.dataset[i].tolist() for i in range(first, end)), [])[:target]
        encoder = sample["text_enc"][sample["enc_mask"] == 1].tolist()
        decoder = sample["text_dec"][sample["dec_mask"] == 1].tolist()
        assert decoder[0] == BOS and sample["labels"][: len(decoder)].tolist() == decoder[1:] + [EOS]
        assert (sample["loss_mask"] == sample["dec_mask"]).all() and (sample["labels"][len(decoder):] == -1).all()
        # Sentinels in order; swapping each back for its span rebuilds the (cut) sentences.
        sentinels = [token for token in encoder if FIRST_SENTINEL <= token < FIRST_SENTINEL + 40]
        assert sentinels == list(range(FIRST_SENTINEL, FIRST_SENTINEL + len(sentinels)))
        marks = [i for i, token in enumerate(decoder) if token in sentinels] + [len(decoder)]
        spans = {decoder[marks[k]]: decoder[marks[k] + 1 : marks[k + 1]] for k in range(len(sentinels))}
        assert sum((spans.get(token, [token]) for token in encoder), []) == original
        masked += sum(len(span) for span in spans.values())
        total += len(original)
        spans_longer_than_one += sum(len(span) > 1 for span in spans.values())
        assert sample["truncated"] == int(sum(train.dataset.sequence_lengths[first:end]) > target)
    assert 0.12 < masked / total <= 0.15 and spans_longer_than_one > 100


def test_cache_files_are_megatrons_and_reused(sentences, tmp_path):
    kwargs = _kwargs(sentences, classification_head=False, path_to_cache=str(tmp_path))
    first = _build(BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig, [100, 20, 20], **kwargs)
    names = sorted(os.listdir(tmp_path))
    hashes = {dataset.unique_description_hash for dataset in first}
    assert {f"{h}-BERTMaskedWordPieceDataset-{suffix}" for h in hashes for suffix in
            ("sample_index.npy", "description.txt", "source.json")} == set(names)
    second = _build(BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig, [100, 20, 20], **kwargs)
    assert sorted(os.listdir(tmp_path)) == names and isinstance(second[0].sample_index, numpy.memmap)
    numpy.testing.assert_array_equal(first[0].sample_index, second[0].sample_index)
    assert len(first[0]) >= 100
    monkeypatch_rank = pytest.MonkeyPatch()
    monkeypatch_rank.setattr(dataset_distributed, "get_rank", lambda: 1)
    try:
        with pytest.raises(RuntimeError, match="rank 0 builds them first"):
            _build(BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig, [100, 20, 20],
                   **{**kwargs, "random_seed": 99})
    finally:
        monkeypatch_rank.undo()


@pytest.mark.parametrize("te_version", ["1.5.0", "1.8.0", "1.11.0"])
@pytest.mark.parametrize("flash", [None, "1"])
def test_config_attention_mask_matches_megatron(mcore, monkeypatch, te_version, flash):
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset as Reference

    if flash is not None:
        monkeypatch.setenv("NVTE_FLASH_ATTN", flash)
    generator = torch.Generator().manual_seed(0)
    encoder = torch.randint(1, 50, (2, 7), generator=generator)
    decoder = torch.randint(1, 50, (2, 5), generator=generator)
    encoder[0, 5:], decoder[1, 3:] = 0, 0
    args = (encoder, decoder, encoder != 0, decoder != 0)
    for use_local in (True, False):
        call = dict(use_local=use_local, test_te_version=te_version)
        if not use_local and flash and te_version == "1.5.0":
            with pytest.raises(ValueError, match="NVTE_FLASH_ATTN=1"):
                T5MaskedWordPieceDataset.config_attention_mask(*args, **call)
            continue
        ours = T5MaskedWordPieceDataset.config_attention_mask(*args, **call)
        theirs = Reference.config_attention_mask(*args, **call)
        for mine, ref in zip(ours, theirs, strict=True):
            if ref is None:
                assert mine is None
            elif isinstance(ref, tuple):
                assert all(torch.equal(m, r) for m, r in zip(mine, ref, strict=True))
            else:
                assert mine.dtype == ref.dtype and torch.equal(mine, ref)
    # Without Transformer Engine (Megatron's version check fails on None) we act as TE 0.0.0.
    absent = T5MaskedWordPieceDataset.config_attention_mask(*args) if not flash else None
    if absent is not None:
        old = T5MaskedWordPieceDataset.config_attention_mask(*args, test_te_version="0.0.0")
        assert absent[1] is None and all(torch.equal(a, b) for a, b in zip(absent[::2], old[::2]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(masking_probability=1.2), r"masking_probability \(1.2\) must lie in \(0, 1\)"),
        (dict(masking_probability=0.0), r"masking_probability \(0.0\)"),
        (dict(short_sequence_probability=-0.1), r"short_sequence_probability \(-0.1\) must lie in \[0, 1\]"),
        (dict(masking_max_ngram=0), r"masking_max_ngram \(0\) must be positive"),
        (dict(masking_do_full_word=None, masking_use_longer_ngrams=None),
         "masking_do_full_word, masking_use_longer_ngrams must be set"),
        (dict(masking_use_geometric_distribution=True, masking_do_permutation=True), "cannot be combined"),
        (dict(sequence_length=4), r"sequence_length \(4\) must be at least 5"),
        (dict(classification_head=None), "classification_head must be set"),
        (dict(tokenizer=NullTokenizer(10)), r"\(NullTokenizer\) must define .*inv_vocab"),
    ],
)
def test_bert_config_errors(sentences, overrides, message):
    kwargs = _kwargs(sentences, classification_head=True)
    with pytest.raises(ValueError, match=message):
        BERTMaskedWordPieceDatasetConfig(**{**kwargs, **overrides})


class _NoSentinels(ToyWordPieceTokenizer):
    additional_special_tokens_ids = property(lambda self: [])


def test_t5_config_and_sample_errors(sentences, tmp_path):
    kwargs = _kwargs(sentences, sequence_length_decoder=32)
    with pytest.raises(ValueError, match=r"sequence_length_decoder \(None\) must be a positive integer"):
        T5MaskedWordPieceDatasetConfig(**{**kwargs, "sequence_length_decoder": None})
    with pytest.raises(ValueError, match=r"sequence_length \(3\) must be at least 4"):
        T5MaskedWordPieceDatasetConfig(**{**kwargs, "sequence_length": 3})
    with pytest.raises(ValueError, match="no additional_special_tokens_ids"):
        T5MaskedWordPieceDatasetConfig(**{**kwargs, "tokenizer": _NoSentinels()})
    with pytest.raises(ValueError, match="no mock data"):
        _build(T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig, [10, None, None], **{**kwargs, "blend": None})
    short = _build(T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig, [50, None, None],
                   path_to_cache=str(tmp_path), **{**kwargs, "sequence_length_decoder": 3})[0]
    with pytest.raises(ValueError, match="sequence_length_decoder 3"):
        for index in range(len(short)):
            short[index]


def _build_t5_on_ranks(prefix: str, cache: str) -> dict:
    train = _build(T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig, [80, 10, 10], path_to_cache=cache,
                   **_kwargs({"a": prefix}, sequence_length_decoder=32))[0]
    return {"sample_index": torch.as_tensor(numpy.asarray(train.sample_index, dtype=numpy.int64)),
            "text_enc": torch.stack([torch.as_tensor(train[i]["text_enc"]) for i in range(len(train))])}


def test_two_ranks_share_one_cache(sentences, tmp_path):
    cache = str(tmp_path / "cache")
    results = run_on_ranks(2, _build_t5_on_ranks, sentences["a"], cache)
    assert all(torch.equal(results[0][key], results[1][key]) for key in results[0])
    assert len([name for name in os.listdir(cache) if name.endswith("sample_index.npy")]) == 3
