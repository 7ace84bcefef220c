"""``helpers.build_sample_idx`` (vectorised) equals a sample-by-sample walk over the documents, quirks included."""

from __future__ import annotations

import numpy
import pytest

from megatron_core.datasets.helpers import build_sample_idx


def _walk(sizes, document_indices, sequence_length, num_samples, extra) -> list[tuple[int, int]]:
    """Each sample takes ``sequence_length + extra`` tokens from where the previous one ended, ``extra`` shared."""
    rows, position, offset = [(0, 0)], 0, 0
    for _ in range(num_samples):
        wanted = sequence_length + extra
        while True:
            left = int(sizes[document_indices[position]]) - offset
            if wanted <= left:  # ends in this document: the next sample starts `extra` tokens back
                offset += wanted - extra
                break
            if position == len(document_indices) - 1:  # the partial last sample ends with the data
                offset = int(sizes[document_indices[position]]) - extra
                break
            wanted -= left
            position, offset = position + 1, 0
        rows.append((position, offset))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_sample_index_equals_the_walk(seed: int) -> None:
    rng = numpy.random.default_rng(seed)
    checked = 0
    for _ in range(150):
        sizes = rng.integers(0 if seed % 2 else 1, int(rng.choice([3, 9, 60])), size=int(rng.integers(1, 30)))
        sizes = sizes.astype(numpy.int32)
        epochs = int(rng.integers(1, 4))
        documents = numpy.tile(numpy.arange(len(sizes), dtype=numpy.int32), epochs)
        rng.shuffle(documents)
        sequence_length, tokens = int(rng.integers(2, 12)), int(sizes.sum())
        if tokens <= 1:
            continue
        for drop_last in (True, False):
            for add_extra in (True, False):
                index = build_sample_idx(sizes, documents, sequence_length, epochs, tokens, drop_last, add_extra)
                expected = _walk(sizes, documents, sequence_length, len(index) - 1, int(add_extra))
                assert index.dtype == numpy.int32
                assert [tuple(row) for row in index.tolist()] == expected, (sizes, documents, sequence_length)
                checked += 1
    assert checked > 500


def test_sample_count_follows_the_partial_sample_rule() -> None:
    sizes = numpy.array([5, 7, 4], dtype=numpy.int32)  # 16 tokens
    documents = numpy.array([2, 0, 1], dtype=numpy.int32)
    # (16 - 1) // 4 = 3 whole samples with the extra token; ceil(15 / 4) = 4 when the partial one is kept.
    assert len(build_sample_idx(sizes, documents, 4, 1, 16, True, True)) - 1 == 3
    partial = build_sample_idx(sizes, documents, 4, 1, 16, False, True)
    assert len(partial) - 1 == 4 and tuple(partial[-1]) == (2, 7 - 1)
    with pytest.raises(ValueError, match="sequence_length > 1"):
        build_sample_idx(sizes, documents, 1, 1, 16)
