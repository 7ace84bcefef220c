"""``utils.flatten_batch_for_packed_sequences``: a packed micro-batch made one THD sequence (Megatron-Core 0.19)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron_core.utils import flatten_batch_for_packed_sequences


def _i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def _batch(mbs=2, seq=8):
    tokens = torch.arange(mbs * seq).reshape(mbs, seq)
    return {
        "tokens": tokens,
        "labels": tokens + 100,
        "loss_mask": torch.ones(mbs, seq),
        "position_ids": torch.arange(seq).repeat(mbs, 1),
        "attention_mask": None,
        # sample 0: documents of 3 and 5 tokens (one padding copy of 8); sample 1: 2, 2 and 4
        "cu_seqlens": _i32([[0, 3, 8, 8], [0, 2, 4, 8]]),
        "max_seqlen": _i32([5, 4]),
    }


def test_batch_without_cu_seqlens_is_unchanged():
    batch = {"tokens": torch.zeros(2, 4), "cu_seqlens": None}
    assert flatten_batch_for_packed_sequences(batch) is batch
    assert batch["tokens"].shape == (2, 4) and batch["cu_seqlens"] is None
    plain = {"tokens": torch.zeros(2, 4)}
    assert flatten_batch_for_packed_sequences(plain)["tokens"].shape == (2, 4)


def test_two_samples_are_joined():
    batch = _batch()
    out = flatten_batch_for_packed_sequences(batch)
    assert out is batch
    assert out["cu_seqlens"].tolist() == [[0, 3, 8, 10, 12, 16]]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["max_seqlen"].tolist() == [5]
    assert out["tokens"].tolist() == [list(range(16))]
    assert out["labels"].tolist() == [list(range(100, 116))]
    assert out["loss_mask"].shape == (1, 16)
    assert out["position_ids"].tolist() == [list(range(8)) * 2]
    assert out["attention_mask"] is None


def test_padded_boundaries_are_joined_too():
    batch = _batch()
    batch["cu_seqlens_padded"] = _i32([[0, 4, 8, 8], [0, 4, 8, 8]])
    out = flatten_batch_for_packed_sequences(batch)
    assert out["cu_seqlens_padded"].tolist() == [[0, 4, 8, 12, 16]]
    assert out["cu_seqlens"].tolist() == [[0, 3, 8, 10, 12, 16]]


def test_one_sample_only_loses_its_padding():
    batch = {"tokens": torch.arange(6).reshape(1, 6), "cu_seqlens": _i32([[0, 2, 6, 6, 6]]),
             "max_seqlen": _i32([4])}
    out = flatten_batch_for_packed_sequences(batch)
    assert out["cu_seqlens"].tolist() == [[0, 2, 6]]
    assert out["max_seqlen"].tolist() == [4]
    assert out["tokens"].tolist() == [list(range(6))]


def test_row_without_the_sequence_length_is_kept_whole():
    # a row that never reaches seq_length (tokens past its last boundary are not in any document)
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "cu_seqlens": _i32([[0, 3, 6], [0, 5, 8]])}
    out = flatten_batch_for_packed_sequences(batch)
    assert out["cu_seqlens"].tolist() == [[0, 3, 6, 13, 16]]


def test_sequence_length_from_labels_or_from_the_boundaries():
    only_labels = {"labels": torch.zeros(3, 4), "cu_seqlens": _i32([[0, 4], [0, 4], [0, 1]])}
    assert flatten_batch_for_packed_sequences(only_labels)["cu_seqlens"].tolist() == [[0, 4, 8, 9]]
    assert only_labels["labels"].shape == (1, 12)
    no_sequences = {"cu_seqlens": _i32([[0, 2, 5, 5], [0, 5, 5, 5]])}
    assert flatten_batch_for_packed_sequences(no_sequences)["cu_seqlens"].tolist() == [[0, 2, 5, 10]]


def test_random_documents_match_the_cumulative_lengths_of_all_documents():
    rng = random.Random(0)
    mbs, seq = 4, 32
    rows, all_docs = [], []
    for _ in range(mbs):
        cuts = sorted(rng.sample(range(1, seq), rng.randint(0, 5)))
        docs = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
        all_docs += docs
        rows.append([0, *itertools.accumulate(docs)])
    width = max(len(r) for r in rows) + 1
    padded = [r + [seq] * (width - len(r)) for r in rows]
    batch = {"tokens": torch.zeros(mbs, seq, dtype=torch.long), "cu_seqlens": _i32(padded)}
    out = flatten_batch_for_packed_sequences(batch)
    assert out["cu_seqlens"].tolist() == [[0, *itertools.accumulate(all_docs)]]


@pytest.mark.parametrize("shape_rows", [[0, 4, 8], [[[0, 8]]]])
def test_boundaries_that_are_not_two_dimensional_are_refused(shape_rows):
    batch = {"tokens": torch.zeros(1, 8), "cu_seqlens": _i32(shape_rows)}
    with pytest.raises(ValueError, match=r"batch\['cu_seqlens'\] must be 2-D .*got shape"):
        flatten_batch_for_packed_sequences(batch)


def test_padded_boundaries_with_a_bad_shape_are_refused():
    batch = _batch()
    batch["cu_seqlens_padded"] = _i32([0, 4, 8, 12, 16])
    with pytest.raises(ValueError, match=r"batch\['cu_seqlens_padded'\] must be 2-D .*got shape \(5,\)"):
        flatten_batch_for_packed_sequences(batch)
