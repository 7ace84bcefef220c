"""Masked-language-model datasets over WordPiece sentences: the config, the sample index and the masking.

Megatron-Core's ``megatron.core.datasets.masked_dataset``. The low-level ``IndexedDataset`` holds
one sequence per sentence and marks document boundaries; samples are runs of whole sentences of
one document (``sentence_mapping.build_mapping``), cached under ``path_to_cache`` (default
``<prefix>/cache/<Class>_indices``) as ``<hash>-<Class>-sample_index.npy``. When ``num_samples``
is given, whole epochs are walked until there are at least that many, so ``len()`` may exceed it.

Masking follows BERT/SpanBERT: candidates are words (a piece starting with ``##`` joins the word
before it when ``masking_do_full_word``), N-gram lengths are drawn with probability proportional
to 1/N (reversed by ``masking_use_longer_ngrams``) or from a clipped geometric(0.2), and about
``masking_probability`` of the tokens are selected. Every sample uses its own
``RandomState(random_seed + idx)``, so samples do not depend on the order they are read in;
the one exception is ``masking_do_permutation``, whose N-gram lengths come from numpy's global
RNG, as in Megatron.
"""

from __future__ import annotations

import logging
import os
import time
from abc import abstractmethod
from dataclasses import dataclass

import numpy

from megatron_core.datasets import distributed
from megatron_core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_core.datasets.index_cache import IndexCache, data_identity
from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.megatron_dataset import MegatronDataset
from megatron_core.datasets.sentence_mapping import build_mapping
from megatron_core.datasets.utils import log_single_rank

__all__ = ["MaskedWordPieceDataset", "MaskedWordPieceDatasetConfig"]

logger = logging.getLogger(__name__)

_GEOMETRIC_P = 0.2

_MASKING_FIELDS = (
    "masking_probability",
    "short_sequence_probability",
    "masking_max_ngram",
    "masking_do_full_word",
    "masking_do_permutation",
    "masking_use_longer_ngrams",
    "masking_use_geometric_distribution",
)


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of the masked WordPiece datasets; every masking field is required."""

    masking_probability: float | None = None
    """Fraction of the tokens to mask, in (0, 1)."""

    short_sequence_probability: float | None = None
    """Probability that a sample targets a random length shorter than the sequence length, in [0, 1]."""

    masking_max_ngram: int | None = None
    """Longest N-gram (in words) masked or permuted at once."""

    masking_do_full_word: bool | None = None
    """Mask whole words (all their ``##`` pieces) rather than single pieces."""

    masking_do_permutation: bool | None = None
    """Also shuffle the tokens of some further N-grams among themselves."""

    masking_use_longer_ngrams: bool | None = None
    """Favour longer N-grams (probabilities proportional to 1/N, reversed)."""

    masking_use_geometric_distribution: bool | None = None
    """Draw N from a geometric distribution with p = 0.2, clipped at ``masking_max_ngram`` (SpanBERT)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__}.tokenizer is required")
        missing = [name for name in _MASKING_FIELDS if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{type(self).__name__}: {', '.join(missing)} must be set")
        if not 0.0 < self.masking_probability < 1.0:
            raise ValueError(f"masking_probability ({self.masking_probability}) must lie in (0, 1)")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(f"short_sequence_probability ({self.short_sequence_probability}) must lie in [0, 1]")
        if self.masking_max_ngram <= 0:
            raise ValueError(f"masking_max_ngram ({self.masking_max_ngram}) must be positive")
        if self.masking_use_geometric_distribution and self.masking_do_permutation:
            raise ValueError(
                "masking_use_geometric_distribution (True) and masking_do_permutation (True) cannot be combined"
            )
        self.require_tokenizer_attributes(("cls", "sep", "mask", "inv_vocab"))
        if self.masking_use_geometric_distribution and self.masking_use_longer_ngrams:
            log_single_rank(logger, logging.WARNING,
                            "masking_use_geometric_distribution overrides masking_use_longer_ngrams")

    def require_tokenizer_attributes(self, names: tuple[str, ...]) -> None:
        """Raise ``ValueError`` naming every attribute in ``names`` that the tokenizer lacks (or sets to None)."""
        missing = []
        for name in names:
            try:
                value = getattr(self.tokenizer, name)
            except (AttributeError, NotImplementedError, ValueError):
                value = None
            if value is None:
                missing.append(name)
        if missing:
            raise ValueError(f"{type(self).__name__}: the tokenizer ({type(self.tokenizer).__name__}) must define "
                             f"{', '.join(missing)}")

    def check_sequence_length(self, reserved: int) -> None:
        """``sequence_length`` must leave at least 2 tokens after the ``reserved`` special tokens."""
        if self.sequence_length - reserved < 2:
            raise ValueError(
                f"{type(self).__name__}: sequence_length ({self.sequence_length}) must be at least {reserved + 2} "
                f"({reserved} special tokens plus 2 text tokens)"
            )


def _word_candidates(token_ids: list[int], tokenizer, full_word: bool) -> tuple[list[int], list[list[int]]]:
    """Word-start flags of every token and the maskable units (positions), skipping CLS and SEP."""
    specials = {tokenizer.cls, tokenizer.sep}
    inv_vocab = tokenizer.inv_vocab
    boundaries: list[int] = []
    candidates: list[list[int]] = []
    for position, token in enumerate(token_ids):
        if token in specials:
            boundaries.append(1)
        elif not inv_vocab[token].startswith("##"):
            boundaries.append(1)
            candidates.append([position])
        else:
            boundaries.append(0)
            if full_word and candidates:
                candidates[-1].append(position)
            else:
                candidates.append([position])
    return boundaries, candidates


def _fit_ngram(candidates: list[list[int]], start: int, n: int, budget: float, used: int) -> list[int] | None:
    """The longest N-gram from ``start`` of at most ``n`` words whose positions fit ``used + len <= budget``."""
    while True:
        positions = [position for word in candidates[start : start + n] for position in word]
        n -= 1
        if budget >= used + len(positions):
            return positions
        if n == 0:
            return None


class MaskedWordPieceDataset(MegatronDataset):
    """Base of the BERT and T5 datasets: splits by document, builds and caches the sentence sample index."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """The split fractions divide documents."""
        return low_level_dataset.document_indices.shape[0] - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: MaskedWordPieceDatasetConfig) -> IndexedDataset:
        """Open ``dataset_path`` (``.bin``/``.idx`` prefix); there is no mock variant."""
        if dataset_path is None:
            raise ValueError(f"{type(config).__name__} needs a blend or blend_per_split: masked datasets have no mock data")
        return IndexedDataset(dataset_path, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """The base attributes plus every masking field."""
        return MegatronDataset._key_config_attributes() + list(_MASKING_FIELDS)

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def _build_sample_index(self, sequence_length: int, min_sentences_per_sample: int) -> numpy.ndarray:
        """The ``[num_samples, 3]`` rows ``(first sentence, end sentence, target length)``, cached on disk."""
        directory = self.config.path_to_cache or os.path.join(
            self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices"
        )
        prefix = self.dataset.path_prefix
        source = data_identity(prefix) if os.path.isfile(f"{prefix}.idx") and os.path.isfile(f"{prefix}.bin") else None
        cache = IndexCache(directory, f"{self.unique_description_hash}-{type(self).__name__}", ("sample_index",),
                           source=source)
        stale = cache.stale_reason() if cache.complete() else None
        if cache.complete() and stale is None:
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices")
            return cache.load()["sample_index"]
        if distributed.get_rank() != 0:
            raise RuntimeError(
                f"{type(self).__name__} {self.index_split.name} indices are missing from {directory} on rank "
                f"{distributed.get_rank()}: rank 0 builds them first (build through BlendedMegatronDatasetBuilder)"
            )
        if stale is not None:
            logger.warning("Rebuilding the %s %s indices cached in %s: %s", type(self).__name__,
                           self.index_split.name, directory, stale)
        started = time.time()
        sample_index = self._build_mapping(sequence_length, min_sentences_per_sample)
        cache.save(self.unique_description, {"sample_index": sample_index})
        log_single_rank(
            logger,
            logging.INFO,
            f"Built the {type(self).__name__} {self.index_split.name} indices in {time.time() - started:.3f} s: "
            f"{sample_index.shape[0]} samples",
        )
        return sample_index

    def _build_mapping(self, sequence_length: int, min_sentences_per_sample: int) -> numpy.ndarray:
        if len(self.indices) == 0:
            if self.num_samples:
                raise ValueError(f"{type(self).__name__} {self.index_split.name}: the split has no documents, but "
                                 f"{self.num_samples} samples were requested")
            return numpy.empty((0, 3), dtype=numpy.uint32)
        # One more boundary closes the split's last document.
        boundaries = numpy.append(self.indices, self.indices[-1] + 1)
        num_epochs = 1 if self.num_samples is None else numpy.iinfo(numpy.int32).max - 1
        return build_mapping(
            self.dataset.document_indices[boundaries],
            self.dataset.sequence_lengths,
            num_epochs,
            self.num_samples,
            sequence_length,
            self.config.short_sequence_probability,
            self.config.random_seed,
            False,
            min_sentences_per_sample,
        )

    def _sample_sentences(self, idx: int) -> tuple[list[list[int]], int]:
        """The sentences (token lists) of sample ``idx`` and its target length."""
        begin, end, target = (int(value) for value in self.sample_index[idx])
        if target > self.config.sequence_length:
            raise ValueError(f"sample {idx} targets {target} tokens, more than sequence_length "
                             f"({self.config.sequence_length}): the cached index does not belong to this config")
        return [self.dataset[i].tolist() for i in range(begin, end)], target

    def _create_masked_lm_predictions(
        self,
        token_ids: list[int],
        target_sequence_length: int,
        numpy_random_state: numpy.random.RandomState,
    ) -> tuple[list[int], list[int], list[int], list[int], list[tuple[list[int], list[int]]]]:
        """Mask ``token_ids``; returns (masked ids, masked positions, their labels, word boundaries, masked spans).

        Positions and labels are sorted by position (permuted positions included), spans (positions,
        original ids) by their first position.
        """
        config = self.config
        boundaries, candidates = _word_candidates(token_ids, config.tokenizer, config.masking_do_full_word)
        n_maskings = min(
            config.masking_probability * target_sequence_length,
            max(1, int(round(len(token_ids) * config.masking_probability))),
        )
        ngram_sizes = numpy.arange(config.masking_max_ngram, dtype=numpy.int64) + 1
        weights = 1.0 / ngram_sizes
        weights = weights / weights.sum(keepdims=True)
        if config.masking_use_longer_ngrams:
            weights = weights[::-1]
        ngram_p = weights / weights.sum(keepdims=True)

        order = list(range(len(candidates)))
        numpy_random_state.shuffle(order)

        masked_ids = list(token_ids)
        records: list[tuple[int, int]] = []
        spans: list[tuple[list[int], list[int]]] = []
        masked: set[int] = set()
        for start in order:
            if len(records) >= n_maskings:
                break
            if config.masking_use_geometric_distribution:
                n = min(numpy_random_state.geometric(_GEOMETRIC_P), config.masking_max_ngram)
            else:
                n = numpy_random_state.choice(ngram_sizes, p=ngram_p)
            positions = _fit_ngram(candidates, start, int(n), n_maskings, len(records))
            if positions is None or any(position in masked for position in positions):
                continue
            for position in positions:
                masked.add(position)
                replacement = self._get_token_mask(numpy_random_state)
                masked_ids[position] = token_ids[position] if replacement is None else replacement
                records.append((position, token_ids[position]))
            spans.append((positions, [token_ids[position] for position in positions]))

        numpy_random_state.shuffle(order)
        if config.masking_do_permutation:
            records.extend(self._permute(masked_ids, candidates, order, masked, n_maskings, ngram_sizes, ngram_p,
                                         numpy_random_state))

        records.sort(key=lambda record: record[0])
        spans.sort(key=lambda span: span[0][0])
        return masked_ids, [r[0] for r in records], [r[1] for r in records], boundaries, spans

    @staticmethod
    def _permute(masked_ids, candidates, order, masked, budget, ngram_sizes, ngram_p, numpy_random_state):
        """Shuffle the tokens of further N-grams among themselves; returns their (position, label) records."""
        chosen: set[int] = set()
        for start in order:
            if len(chosen) >= budget:
                break
            # Megatron draws these N-gram lengths from numpy's global RNG, not the sample's.
            n = numpy.random.choice(ngram_sizes, p=ngram_p)
            positions = _fit_ngram(candidates, start, int(n), budget, len(chosen))
            if positions is None or any(p in masked or p in chosen for p in positions):
                continue
            chosen.update(positions)
        targets = sorted(chosen)
        sources = list(targets)
        numpy_random_state.shuffle(sources)
        before = list(masked_ids)
        records = []
        for target, source in zip(targets, sources):
            masked_ids[target] = before[source]
            records.append((target, before[target]))
        return records

    @abstractmethod
    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> int | None:
        """The id that replaces a selected token (``None``: keep it)."""
