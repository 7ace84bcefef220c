"""Numba-compiled blending loops, used by ``datasets.helpers`` when numba is installed.

The blending builders are greedy and sequential (each choice depends on every earlier one), so numpy
cannot vectorise them; in Python they cost about 1 µs per sample and dataset. numba, a core
dependency (the ``fast`` extra is kept as an alias), compiles the same loops to machine code at the speed of
Megatron's C++ helpers. The arithmetic is the same IEEE double arithmetic in the same order (no
fast-math, no fused multiply-add), so the results are identical to the Python loops. This module is
the one place numba is imported (:func:`njit_or_none`, which ``datasets.sentence_mapping`` also uses);
without it :func:`compiled_kernels` returns ``None``.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

_DISABLE_ENV = "MEGATRON_CORE_DISABLE_NUMBA"


# The loops below are the one implementation of the blending rule: numba compiles them, and without numba
# ``datasets.helpers`` runs them as they are on Python lists (1-D arrays or lists both work).


def _greedy(weights, taken, dataset_index, dataset_sample_index, size):
    num_datasets = len(weights)
    for sample in range(size):
        sample_double = float(sample) if sample > 1 else 1.0
        best = 0
        best_error = weights[0] * sample_double - float(taken[0])
        for dataset in range(1, num_datasets):
            error = weights[dataset] * sample_double - float(taken[dataset])
            if error > best_error:
                best_error = error
                best = dataset
        dataset_index[sample] = best
        dataset_sample_index[sample] = taken[best]
        taken[best] += 1


def _exhaustive(weights, sizes, taken, dataset_index, dataset_sample_index, total):
    num_datasets = len(weights)
    lowest = -1.7976931348623157e308
    for sample in range(total):
        sample_double = float(sample) if sample > 1 else 1.0
        best = -1
        best_error = lowest
        for dataset in range(num_datasets):
            if taken[dataset] >= sizes[dataset]:
                continue
            error = weights[dataset] * sample_double - float(taken[dataset])
            if error > best_error:
                best_error = error
                best = dataset
        dataset_index[sample] = best
        dataset_sample_index[sample] = taken[best]
        taken[best] += 1


def njit_or_none(function: Any) -> Any:
    """``function`` compiled with numba, or ``None`` when numba is absent or ``MEGATRON_CORE_DISABLE_NUMBA`` is set.

    Compiled code is cached on disk next to its module when that is writable (numba's ``cache=True``),
    else compiled per process.
    """
    if os.environ.get(_DISABLE_ENV, "0") not in ("", "0"):
        return None
    try:
        import numba
    except ImportError:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return numba.njit(cache=True, nogil=True)(function)
    except Exception:  # an unwritable cache directory: compile without the on-disk cache
        return numba.njit(nogil=True)(function)


@functools.cache
def compiled_kernels() -> tuple[Any, Any] | None:
    """``(greedy, exhaustive)`` compiled with numba, or ``None`` when numba is absent or disabled.

    Set ``MEGATRON_CORE_DISABLE_NUMBA=1`` to force the pure-Python loops.
    """
    greedy = njit_or_none(_greedy)
    if greedy is None:
        return None
    return greedy, njit_or_none(_exhaustive)
