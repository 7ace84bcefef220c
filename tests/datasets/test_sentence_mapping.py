"""``build_mapping`` and its random streams: bit-identical to Megatron's C++ helpers and to the C++ standard."""

from __future__ import annotations

import numpy
import pytest

from megatron_core.datasets import sentence_mapping
from megatron_core.datasets.mersenne_twister import MT19937_64, mt19937_stream
from megatron_core.datasets.sentence_mapping import build_mapping


def test_streams_match_the_cpp_standard():
    # [rand.predef]: the 10000th draw of a default-constructed (seed 5489) engine.
    assert mt19937_stream(5489).random_raw(10000)[-1] == 4123659995
    generator = MT19937_64(5489)
    assert int(generator.draw(1)[0]) == 14514284786278117030
    assert int(generator.draw(9999)[-1]) == 9981545732273789042


def _random_case(rng: numpy.random.Generator, trial: int):
    counts = rng.integers(0, 8, int(rng.integers(1, 60)))
    docs = numpy.concatenate(([0], numpy.cumsum(counts))).astype(numpy.int64)
    sizes = rng.integers(1, 40, int(docs[-1]) + 1).astype(numpy.int32)
    if trial % 4 == 0:
        sizes[rng.integers(0, len(sizes))] = 600
    sequence_length = int(rng.integers(2, 100))
    short_seq_prob = float(rng.choice([0.0, 0.1, 0.25, 0.4, 0.5, 1.0]))  # 0.4: 1/p = 2.5 rounds up in C++
    return docs, sizes, sequence_length, short_seq_prob, int(rng.integers(1, 10000)), int(rng.integers(1, 3))


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "python"])
def test_build_mapping_matches_megatron(mcore, monkeypatch, compiled):
    from megatron.core.datasets import helpers_cpp

    if not compiled:
        monkeypatch.setattr(sentence_mapping, "_kernels", lambda: None)
    elif sentence_mapping._kernels() is None:
        pytest.skip("numba is not installed")
    rng = numpy.random.default_rng(0)
    compared = 0
    for trial in range(40):
        docs, sizes, sequence_length, prob, seed, min_sentences = _random_case(rng, trial)
        num_samples = int(rng.integers(1, 300))
        epochs = 1 if trial % 3 == 0 else numpy.iinfo(numpy.int32).max - 1
        reference = helpers_cpp.build_mapping(docs, sizes, epochs, 2**63 if epochs == 1 else num_samples,
                                              sequence_length, prob, seed, False, min_sentences)
        if epochs > 1 and reference.shape[0] == 0:
            continue
        ours = build_mapping(docs, sizes, epochs, None if epochs == 1 else num_samples, sequence_length, prob,
                             seed, False, min_sentences)
        assert ours.dtype == reference.dtype == numpy.uint32
        numpy.testing.assert_array_equal(ours, reference)
        compared += 1
    assert compared > 30


def test_one_epoch_covers_every_eligible_document_once():
    rng = numpy.random.default_rng(3)
    docs, sizes, _, _, _, _ = _random_case(rng, 0)
    rows = build_mapping(docs, sizes, 1, None, 30, 0.3, 11, False, 2).astype(numpy.int64)
    covered = numpy.zeros(len(sizes), dtype=int)
    for first, end, target in rows:
        assert 2 <= target <= 30
        document = numpy.searchsorted(docs, first, side="right") - 1
        assert docs[document] <= first < end <= docs[document + 1]
        covered[first:end] += 1
    for first, end in zip(docs[:-1], docs[1:]):
        eligible = end - first >= 2 and not (sizes[first:end] > 512).any()
        assert (covered[first:end] == int(eligible)).all()


def test_no_sample_raises_instead_of_spinning():
    docs = numpy.array([0, 1, 2, 4], dtype=numpy.int64)
    sizes = numpy.array([5, 5, 700, 3], dtype=numpy.int32)
    with pytest.raises(ValueError, match="no sample can be built from 3 documents .*min_num_sent=2.* 10 samples"):
        build_mapping(docs, sizes, 1000, 10, 20, 0.0, 1, False, 2)
    with pytest.raises(ValueError, match="max_seq_length=1"):
        build_mapping(docs, sizes, 1, None, 1, 0.0, 1, False, 2)
