"""Small dataset helpers: the ``Split`` enum, weight normalisation and ``--data-path`` blend parsing.

Mirrors ``megatron.core.datasets.utils``. ``get_blend_from_list`` turns Megatron's flat command-line
form (``["30", "prefix_a", "70", "prefix_b"]`` or ``["prefix_a", "prefix_b"]``) into a config blend.
``compile_helpers`` is a no-op kept for Megatron scripts: our index helpers need no compiler.
"""

from __future__ import annotations

import logging
from enum import Enum

import numpy

from megatron_core._rank_utils import log_single_rank  # noqa: F401  (re-exported: Megatron's path)

logger = logging.getLogger(__name__)


_helpers_logged = False


def compile_helpers() -> None:
    """No-op (Megatron compiles its C++ dataset helpers here; ours are numpy). Logs once per process."""
    global _helpers_logged
    if not _helpers_logged:
        _helpers_logged = True
        logger.info("compile_helpers: nothing to compile (megatron_core's dataset helpers are pure Python/numpy)")


class Split(Enum):
    """The three dataset splits, in Megatron's order."""

    train = 0
    valid = 1
    test = 2


def normalize(weights: list[float]) -> list[float]:
    """Scale ``weights`` so that they sum to one (float64 arithmetic, as Megatron)."""
    array = numpy.array(weights, dtype=numpy.float64)
    total = numpy.sum(array)
    if not total > 0:
        raise ValueError(f"weights {list(weights)} must sum to a positive number")
    return (array / total).tolist()


def get_blend_from_list(blend: list[str] | None) -> tuple[list[str], list[float] | None] | None:
    """Parse a flat blend list into ``(prefixes, weights)``; weights are None when not given.

    An even-length list whose every other entry parses as a float is read as ``weight prefix``
    pairs; anything else is a plain list of prefixes.
    """
    if blend is None:
        return None
    if len(blend) % 2 == 0:
        raw_weights, raw_prefixes = blend[0::2], blend[1::2]
        weights = []
        for raw in raw_weights:
            try:
                weights.append(float(raw))
            except ValueError:
                weights = None
                break
        if weights is not None:
            return [prefix.strip() for prefix in raw_prefixes], weights
    return [prefix.strip() for prefix in blend], None


