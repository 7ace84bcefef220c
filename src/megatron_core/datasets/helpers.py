"""Index builders of Megatron's ``helpers.cpp`` in numpy: the GPT sample index and the blending indices.

``build_sample_idx`` is fully vectorised: sample ``i`` starts at flat token position
``i * sequence_length`` of the documents laid end to end in ``document_indices`` order, so how many
sample boundaries each document holds follows from its end alone (one ``cumsum``, one division), and
the rows are those counts expanded with ``repeat`` (no search per sample: millions of samples, such as
the mock corpus at a short sequence length, take a fraction of a second). The results (values and
dtype) equal the C++ walk, including its two quirks: with ``add_extra_token_to_sequence`` off a boundary that falls on
a document's end is recorded as ``(that document, its length)``, and a partial last sample (kept
when ``drop_last_partial_sequence`` is False) ends at ``(last document, its length - extra)``; the
sample count of that case uses float32 division as the C++ code does.

The blending builders are greedy and sequential by nature (each choice depends on all earlier
ones). numba is a core dependency, so a default install runs them as compiled loops
(``datasets.blending_jit``), as fast as the C++ helpers (``benchmarks/RESULTS.md``); with numba
missing or ``MEGATRON_CORE_DISABLE_NUMBA=1`` they run as plain loops over Python floats (about 35x
slower). Both are the same IEEE double arithmetic as the C++ ``double`` code, in the same order,
and ties go to the lowest dataset index as in C++, so every path gives identical indices.

``build_mapping`` (the BERT/T5 sentence sample index) lives in ``datasets.sentence_mapping`` and is
re-exported here under Megatron's name.
"""

from __future__ import annotations

import numpy

from megatron_core.datasets.blending_jit import _exhaustive, _greedy, compiled_kernels
from megatron_core.datasets.sentence_mapping import build_mapping  # noqa: F401 - Megatron's helpers.build_mapping


def _num_samples(total_tokens: int, sequence_length: int, drop_last_partial_sequence: bool) -> int:
    if drop_last_partial_sequence:
        return total_tokens // sequence_length
    quotient = numpy.float32(total_tokens) / numpy.float32(sequence_length)
    return int(numpy.ceil(quotient))


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """The ``[num_samples + 1, 2]`` sample index: (position in ``document_indices``, token offset) rows.

    Consecutive rows bound one sample of ``sequence_length`` tokens (plus one extra token shared
    with the next sample when ``add_extra_token_to_sequence``). The dtype is int32 unless
    ``max(len(document_indices), sizes.max())`` needs int64, as in Megatron.
    """
    if sequence_length <= 1 or num_epochs <= 0 or tokens_per_epoch <= 1:
        raise ValueError(
            f"build_sample_idx needs sequence_length > 1, num_epochs > 0 and tokens_per_epoch > 1; got "
            f"{sequence_length}, {num_epochs}, {tokens_per_epoch}"
        )
    extra = int(bool(add_extra_token_to_sequence))
    sizes = numpy.asarray(sizes)
    document_indices = numpy.asarray(document_indices)
    max_value = max(document_indices.shape[0], int(sizes.max()))
    dtype = numpy.int32 if max_value <= numpy.iinfo(numpy.int32).max else numpy.int64
    num_samples = _num_samples(num_epochs * tokens_per_epoch - extra, sequence_length, drop_last_partial_sequence)

    document_lengths = sizes[document_indices].astype(numpy.int64)
    document_ends = numpy.cumsum(document_lengths)
    # Boundary k (1..num_samples) lies at token k * sequence_length; the C++ walk stops in the first document
    # whose end reaches boundary + extra, so the documents up to j hold the boundaries k <= (end_j - extra) / length.
    reached = numpy.clip((document_ends - extra) // sequence_length, 0, num_samples)
    per_document = numpy.diff(reached, prepend=0)
    inside = int(reached[-1])  # boundaries past the last document's end: the partial last sample's end

    sample_index = numpy.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[0] = 0
    sample_index[1 : inside + 1, 0] = numpy.repeat(numpy.arange(len(document_ends), dtype=dtype), per_document)
    offsets = numpy.arange(1, inside + 1, dtype=numpy.int64) * sequence_length
    offsets -= numpy.repeat(document_ends - document_lengths, per_document)  # minus the document's start
    sample_index[1 : inside + 1, 1] = offsets
    sample_index[inside + 1 :, 0] = len(document_ends) - 1
    sample_index[inside + 1 :, 1] = int(sizes[document_indices[-1]]) - extra
    return sample_index


def build_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    weights: list[float] | numpy.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool = False,
) -> None:
    """Fill ``dataset_index`` (int16) and ``dataset_sample_index`` (int64) for ``size`` blended samples.

    Each sample goes to the dataset whose share is furthest behind its weight:
    ``argmax_d(weights[d] * max(i, 1) - taken[d])``.
    """
    weights = [float(weight) for weight in weights][:num_datasets]
    kernels = compiled_kernels()
    if kernels is not None:
        taken_array = numpy.zeros(num_datasets, dtype=numpy.int64)
        kernels[0](numpy.asarray(weights, dtype=numpy.float64), taken_array, dataset_index, dataset_sample_index, size)
        if verbose:
            _report(weights, taken_array.tolist(), size)
        return
    taken = [0] * num_datasets
    chosen = [0] * size
    sample_of = [0] * size
    _greedy(weights, taken, chosen, sample_of, size)  # the kernel's own loop, on Python lists
    dataset_index[:size] = numpy.asarray(chosen, dtype=numpy.int16)
    dataset_sample_index[:size] = numpy.asarray(sample_of, dtype=numpy.int64)
    if verbose:
        _report(weights, taken, size)


def _report(weights: list[float], taken: list[int], size: int) -> None:
    for dataset, weight in enumerate(weights):
        print(f"   dataset {dataset}, input: {weight}, achieved: {taken[dataset] / max(size, 1)}")


def build_exhaustive_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    sizes: list[int] | numpy.ndarray,
    num_datasets: int,
) -> None:
    """Blend by drawing exactly ``sizes[d]`` samples from every dataset ``d``, in proportion to ``sizes``.

    A dataset drops out once exhausted; the others keep the greedy error-minimising order.
    """
    sizes = [int(size) for size in sizes][:num_datasets]
    total = sum(sizes)
    weights = [size / float(total) for size in sizes]
    kernels = compiled_kernels()
    if kernels is not None:
        kernels[1](
            numpy.asarray(weights, dtype=numpy.float64), numpy.asarray(sizes, dtype=numpy.int64),
            numpy.zeros(num_datasets, dtype=numpy.int64), dataset_index, dataset_sample_index, total,
        )
        return
    chosen = [0] * total
    sample_of = [0] * total
    _exhaustive(weights, sizes, [0] * num_datasets, chosen, sample_of, total)  # the kernel's loop, on lists
    dataset_index[:total] = numpy.asarray(chosen, dtype=numpy.int16)
    dataset_sample_index[:total] = numpy.asarray(sample_of, dtype=numpy.int64)
