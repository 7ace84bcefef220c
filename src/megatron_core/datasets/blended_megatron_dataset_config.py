"""``BlendedMegatronDatasetConfig``: what to build (blends, split, sequence length, seed, cache path).

Megatron-Core's config (``megatron.core.datasets.blended_megatron_dataset_config``) with the same
fields and derived values: ``split`` ("969,30,1") is normalised into ``split_matrix`` (book-ends per
split), and ``mock`` becomes True when neither ``blend`` nor ``blend_per_split`` is given (then
``split`` is "1,1,1"). Invalid combinations raise ``ValueError`` naming the fields instead of
Megatron's bare asserts. ``fast_cache_load`` and ``defer_npy_index_mmap`` are not supported.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from megatron_core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

Blend = tuple[list[str], list[float] | None]


def _check_blend(name: str, blend: Any) -> None:
    if not isinstance(blend, (tuple, list)) or len(blend) != 2 or isinstance(blend[0], str):
        raise ValueError(f"{name} must be a (prefixes, weights or None) pair, got {blend!r}")
    prefixes, weights = blend
    if len(prefixes) == 0:
        raise ValueError(f"{name} has no dataset prefixes")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(
                f"{name}: {len(prefixes)} prefixes but {len(weights)} weights; they must be equal in number"
            )
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"{name}: weights must be positive, got {list(weights)}")


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration shared by every Megatron dataset."""

    random_seed: int
    """Seed of every RNG used while building indices."""

    sequence_length: int
    """Tokens per sample."""

    blend: Blend | None = None
    """``(prefixes, weights)``; weights None means "in proportion to the dataset sizes". Not with blend_per_split."""

    blend_per_split: list[Blend | None] | None = None
    """One blend (or None) for each of train, valid and test. Not with blend or split."""

    multiple_validation_sets: bool | None = None
    """Keep each validation prefix as its own dataset instead of blending them."""

    full_validation: bool | None = None
    """Validate on whole epochs (validation sizes None)."""

    split: str | None = None
    """Comma-separated train/valid/test weights of one distribution, e.g. ``"969,30,1"``."""

    split_matrix: list[tuple[float, float] | None] | None = field(init=False, default=None)
    """Derived from ``split``: the ``(begin, end)`` fraction of the documents per split, or None."""

    num_dataset_builder_threads: int = 1
    """Threads that build the per-prefix datasets of a blend."""

    path_to_cache: str | None = None
    """Directory of the cached index files (default: ``<prefix>/cache/<Class>_indices``)."""

    mmap_bin_files: bool = True
    """Memory-map the ``.bin`` files (else read them with file calls)."""

    mock: bool = field(init=False, default=False)
    """Derived: True when there is neither blend nor blend_per_split."""

    tokenizer: Any = None
    """The ``MegatronTokenizer``; datasets use its ``eod``, ``pad``, ``vocab_size`` and ``unique_identifiers``."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended dataset builds, so blending never runs short."""

    allow_ambiguous_pad_tokens: bool | None = False
    """Keep the tokenizer's pad id even when it equals another special id (not recommended)."""

    fast_cache_load: bool = False
    """Megatron's trust-the-cache loading; not supported here (must stay False)."""

    defer_npy_index_mmap: bool = False
    """Megatron's lazy index loading; not supported here (must stay False)."""

    def __post_init__(self) -> None:
        for name in ("fast_cache_load", "defer_npy_index_mmap"):
            if getattr(self, name):
                raise ValueError(f"{name}=True is not supported by megatron_core (see docs/compat.md)")
        if self.sequence_length is None or self.sequence_length < 1:
            raise ValueError(f"sequence_length ({self.sequence_length}) must be a positive integer")
        if self.mid_level_dataset_surplus < 0:
            raise ValueError(f"mid_level_dataset_surplus ({self.mid_level_dataset_surplus}) must be >= 0")
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError("blend and blend_per_split are incompatible: give one of them")
            if self.split is not None:
                raise ValueError(f"split ({self.split!r}) and blend_per_split are incompatible")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(
                    f"blend_per_split must contain {len(Split)} blends (train, valid, test), "
                    f"got {len(self.blend_per_split)}"
                )
            for split in Split:
                if self.blend_per_split[split.value] is None:
                    log_single_rank(logger, logging.INFO, f"blend not provided for {split.name} split")
                else:
                    _check_blend(f"blend_per_split[{split.value}] ({split.name})", self.blend_per_split[split.value])
            return
        if self.blend is not None:
            _check_blend("blend", self.blend)
            if self.split is None:
                raise ValueError("split must be provided when blend is not None")
        else:
            self.mock = True
            self.split = "1,1,1"
        self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))


def parse_and_normalize_split(split: str) -> list[float]:
    """``"99,1"`` -> ``[0.99, 0.01, 0.0]``: parse up to three non-negative weights and normalise.

    Unlike Megatron (which picks the digits out and reads ``"90,-10,0"`` as ``90,10,0``), every
    comma-separated piece must be a plain non-negative number.
    """
    pieces = [piece.strip() for piece in split.split(",")]
    bad = [piece for piece in pieces if not re.fullmatch(r"\d+(?:\.\d*)?|\.\d+", piece)]
    if bad:
        raise ValueError(f"split {split!r}: {bad[0]!r} is not a non-negative number (write weights like '969,30,1')")
    values = [float(value) for value in pieces]
    values += [0.0] * (len(Split) - len(values))
    if len(values) != len(Split) or any(value < 0 for value in values) or sum(values) <= 0:
        raise ValueError(f"split {split!r} must hold at most {len(Split)} non-negative weights with a positive sum")
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: list[float], vector_b: list[float] | None = None
) -> list[tuple[float, float] | None]:
    """Turn split fractions into ``(begin, end)`` book-ends; with ``vector_b``, keep the overlap of both.

    ``[0.99, 0.01, 0.0]`` -> ``[(0, 0.99), (0.99, 1.0), None]``.
    """
    if vector_b is None:
        vector_b = vector_a

    def bookends(vector: list[float]) -> list[tuple[float, float]]:
        edges = functools.reduce(lambda acc, value: acc + [acc[-1] + value], vector, [0])
        return list(zip(edges[:-1], edges[1:]))

    matrix: list[tuple[float, float] | None] = []
    for (begin_a, end_a), (begin_b, end_b) in zip(bookends(vector_a), bookends(vector_b)):
        begin, end = max(begin_a, begin_b), min(end_a, end_b)
        matrix.append(None if end <= begin else (begin, end))
    return matrix
