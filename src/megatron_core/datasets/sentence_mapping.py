"""``build_mapping``: the sentence-level sample index of the BERT and T5 datasets, as Megatron's C++ builds it.

Megatron's ``helpers.build_mapping`` walks every document's sentences, epoch after epoch, closing
a sample once it holds at least ``target`` tokens and ``min_num_sent`` sentences (or the
document ends, or only one sentence would remain). Documents with fewer than ``min_num_sent``
sentences, or with several sentences of which one is longer than 512 tokens, are skipped. With
``short_seq_prob`` > 0 each target is redrawn from ``std::mt19937(seed)``: with probability
about ``1 / round(1 / short_seq_prob)`` it is a random length in ``[2, max_seq_length]``. The rows
``(first sentence, end sentence, target)`` are finally shuffled by Fisher-Yates with
``std::mt19937_64(seed + 1)``. Epochs stop once ``max_num_samples`` rows exist, checked only
between epochs, so whole epochs are kept.

Both generators are reproduced exactly (``datasets.mersenne_twister``), so the rows, their order
and their dtype (uint32, or uint64 past 2**32 sentences) equal the C++ result. The walk and the
swaps are loops; with numba installed they are compiled (``datasets.blending_jit.njit_or_none``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy

from megatron_core.datasets.blending_jit import njit_or_none
from megatron_core.datasets.mersenne_twister import MT19937_64, mt19937_stream

__all__ = ["LONG_SENTENCE_LEN", "build_mapping"]

LONG_SENTENCE_LEN = 512
"""A document with more than one sentence is skipped when one of them is longer than this."""

_CHUNK = 1 << 20  # draws (or swaps) handled per kernel call, which bounds the temporary arrays


def _walk(starts, ends, sizes, offset, max_seq_length, short_seq_ratio, min_num_sent, draws, out):  # noqa: PLR0913
    """Cut the documents ``[starts[d], ends[d])`` into samples written to ``out``; returns (rows, draws used)."""
    count = 0
    used = 0
    for d in range(len(starts)):
        first = starts[d]
        last = ends[d]
        remain = last - first
        previous = first
        seq_len = 0
        num_sent = 0
        target = max_seq_length
        if short_seq_ratio > 0:
            draw = draws[used]
            used += 1
            if draw % short_seq_ratio == 0:
                target = 2 + draw % (max_seq_length - 1)
        for sentence in range(first, last):
            seq_len += sizes[sentence - offset]
            num_sent += 1
            remain -= 1
            if (seq_len >= target and remain > 1 and num_sent >= min_num_sent) or remain == 0:
                out[count, 0] = previous
                out[count, 1] = sentence + 1
                out[count, 2] = target
                count += 1
                previous = sentence + 1
                seq_len = 0
                num_sent = 0
                target = max_seq_length
                if short_seq_ratio > 0:
                    draw = draws[used]
                    used += 1
                    if draw % short_seq_ratio == 0:
                        target = 2 + draw % (max_seq_length - 1)
    return count, used


def _swap(order, positions, partners):
    """Fisher-Yates steps: swap ``order[positions[k]]`` with ``order[partners[k]]`` in turn."""
    for k in range(len(positions)):
        i = positions[k]
        j = partners[k]
        order[i], order[j] = order[j], order[i]


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    walk = njit_or_none(_walk)
    return None if walk is None else (walk, njit_or_none(_swap))


def _short_seq_ratio(short_seq_prob: float) -> int:
    # C++ ``round`` goes half away from zero (Python's ``round`` goes half to even).
    return 0 if short_seq_prob <= 0 else int(math.floor(1.0 / short_seq_prob + 0.5))


def _eligible_documents(docs: numpy.ndarray, sizes: numpy.ndarray, min_num_sent: int) -> tuple[numpy.ndarray, ...]:
    starts, ends = docs[:-1], docs[1:]
    counts = ends - starts
    long_before = numpy.concatenate(([0], numpy.cumsum(sizes > LONG_SENTENCE_LEN, dtype=numpy.int64)))
    has_long = long_before[ends] > long_before[starts]
    keep = (counts >= min_num_sent) & ~((counts > 1) & has_long)
    return starts[keep], ends[keep]


def _walk_epoch(starts, ends, sizes, max_seq_length, ratio, min_num_sent, draw_source, pending, kernels):
    """One pass over the documents in chunks; returns (rows, draws left over)."""
    # Each document costs one draw plus one per sample (at most one per sentence).
    cost = numpy.cumsum((ends - starts) + 1)
    rows, begin, spent = [], 0, 0
    while begin < len(starts):
        end = max(begin + 1, int(numpy.searchsorted(cost, spent + _CHUNK, side="right")))
        need = int(cost[end - 1]) - spent
        spent = int(cost[end - 1])
        if ratio > 0 and pending.shape[0] < need:
            pending = numpy.concatenate((pending, draw_source.random_raw(need - pending.shape[0]).astype(numpy.int64)))
        chunk_starts, chunk_ends = starts[begin:end], ends[begin:end]
        low, high = int(chunk_starts.min()), int(chunk_ends.max())
        out = numpy.empty((need, 3), dtype=numpy.int64)
        if kernels is not None:
            count, used = kernels[0](chunk_starts, chunk_ends, sizes[low:high], low, max_seq_length, ratio,
                                     min_num_sent, pending, out)
        else:
            count, used = _walk(chunk_starts.tolist(), chunk_ends.tolist(), sizes[low:high].tolist(), low,
                                max_seq_length, ratio, min_num_sent, pending[:need].tolist(), out)
        rows.append(out[:count])
        pending = pending[used:]
        begin = end
    return rows, pending


def _shuffle_rows(maps: numpy.ndarray, seed: int, kernels) -> numpy.ndarray:
    """Fisher-Yates over the rows with ``std::mt19937_64(seed + 1)``: step ``i`` swaps rows ``i`` and ``draw % (i + 1)``."""
    num_samples = maps.shape[0]
    generator = MT19937_64(seed + 1)
    order = numpy.arange(num_samples, dtype=numpy.int64)
    order_list = None if kernels is not None else order.tolist()
    for top in range(num_samples - 1, 0, -_CHUNK):
        positions = numpy.arange(top, max(top - _CHUNK, 0), -1, dtype=numpy.uint64)
        partners = (generator.draw(positions.shape[0]) % (positions + numpy.uint64(1))).astype(numpy.int64)
        if kernels is not None:
            kernels[1](order, positions.astype(numpy.int64), partners)
        else:
            _swap(order_list, positions.tolist(), partners.tolist())
    if order_list is not None:
        order = numpy.asarray(order_list, dtype=numpy.int64)
    return maps[order]


def build_mapping(
    docs: numpy.ndarray,
    sizes: numpy.ndarray,
    num_epochs: int,
    max_num_samples: int | None,
    max_seq_length: int,
    short_seq_prob: float,
    seed: int,
    verbose: bool = False,
    min_num_sent: int = 2,
) -> numpy.ndarray:
    """The shuffled ``[num_samples, 3]`` rows ``(first sentence, end sentence, target length)``.

    ``docs`` holds the sentence boundaries of the documents (``len(docs) - 1`` documents),
    ``sizes`` every sentence's length. ``max_num_samples`` None walks ``num_epochs`` epochs.
    """
    if num_epochs <= 0 or max_seq_length <= 1 or not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(
            f"build_mapping needs num_epochs > 0, max_seq_length > 1 and 0 <= short_seq_prob <= 1; got "
            f"num_epochs={num_epochs}, max_seq_length={max_seq_length}, short_seq_prob={short_seq_prob}"
        )
    docs = numpy.asarray(docs, dtype=numpy.int64)
    sizes = numpy.asarray(sizes, dtype=numpy.int64)
    dtype = numpy.uint64 if sizes.shape[0] > numpy.iinfo(numpy.uint32).max else numpy.uint32
    ratio = _short_seq_ratio(short_seq_prob)
    starts, ends = _eligible_documents(docs, sizes, min_num_sent)
    kernels = _kernels()
    draw_source = mt19937_stream(seed)
    pending = numpy.empty(0, dtype=numpy.int64)
    rows: list[numpy.ndarray] = []
    total = 0
    for epoch in range(num_epochs):
        if max_num_samples is not None and total >= max_num_samples:
            break
        epoch_rows, pending = _walk_epoch(starts, ends, sizes, max_seq_length, ratio, min_num_sent, draw_source,
                                          pending, kernels)
        produced = sum(part.shape[0] for part in epoch_rows)
        if produced == 0 and max_num_samples is not None and max_num_samples > 0:
            raise ValueError(
                f"build_mapping: no sample can be built from {len(docs) - 1} documents ({len(starts)} have at least "
                f"min_num_sent={min_num_sent} sentences and no sentence longer than {LONG_SENTENCE_LEN} tokens), "
                f"but {max_num_samples} samples were requested"
            )
        rows.extend(epoch_rows)
        total += produced
        if verbose:
            print(f"    epoch {epoch}: {produced} samples, {total} in all")
    maps = numpy.concatenate(rows) if rows else numpy.empty((0, 3), dtype=numpy.int64)
    return _shuffle_rows(maps, seed, kernels).astype(dtype)
