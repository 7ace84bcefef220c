"""``GPTDataset``: fixed-length GPT samples packed from an ``IndexedDataset``, with Megatron's exact indices.

Three indices define the samples (``megatron.core.datasets.gpt_dataset``):

* document index: the split's documents repeated once per epoch and shuffled with
  ``numpy.random.RandomState(random_seed)``; when the last epoch would give fewer than 80% of a
  full epoch's samples it is shuffled separately, so the partial epoch is still a uniform draw;
* sample index (``helpers.build_sample_idx``): where each sample starts; samples are cut from the
  documents laid end to end, so they span document boundaries, and consecutive samples share
  one token when ``add_extra_token_to_sequence``;
* shuffle index: a permutation of the samples (the separate last epoch is shuffled on its own).

They are cached under ``path_to_cache`` (default ``<prefix>/cache/GPTDataset_indices``) with names
keyed by the MD5 of the dataset's description; rank 0 builds them, the others load them after the
builder's barrier. ``MockGPTDataset`` runs the same logic on synthetic documents.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy
import torch

from megatron_core.datasets import distributed
from megatron_core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_core.datasets.gpt_masks import get_ltor_masks_and_position_ids
from megatron_core.datasets.helpers import build_sample_idx
from megatron_core.datasets.index_cache import IndexCache, data_identity
from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.megatron_dataset import MegatronDataset
from megatron_core.datasets.object_storage_utils import ObjectStorageConfig, is_object_storage_path
from megatron_core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of GPT datasets; ``reset_position_ids``, ``reset_attention_mask`` and ``eod_mask_loss`` are required."""

    reset_position_ids: bool | None = None
    """Restart position ids after every EOD token."""

    reset_attention_mask: bool | None = None
    """Stop attention across EOD tokens (block-diagonal causal mask)."""

    eod_mask_loss: bool | None = None
    """Zero the loss mask at EOD tokens."""

    create_attention_mask: bool = True
    """Return a ``[1, s, s]`` boolean ``attention_mask`` (True = masked)."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last, partial validation sample (else it is padded)."""

    add_extra_token_to_sequence: bool = True
    """Read ``sequence_length + 1`` tokens per sample so tokens and labels both have ``sequence_length``."""

    object_storage_cache_path: str | None = None
    """Local directory caching the ``.idx`` of ``s3://`` / ``msc://`` prefixes (required for them)."""

    data_parallel_size: int = 1
    """Data-parallel size (bookkeeping for packed-sequence variants)."""

    sequence_parallel_size: int = 0
    """Sequence-parallel size (bookkeeping for packed-sequence variants)."""

    hybrid_context_parallel: bool = False
    """Megatron's hybrid context parallel packing flag (bookkeeping)."""

    sequences_per_dataset: dict[str, tuple[int, int]] | None = None
    """Per-prefix ``(sequence count, document count)``; checked against each index file when given."""

    token_dtype_code: int | None = field(init=False, default=None)
    """Derived: 8 (uint16) when the vocab fits in 65536 ids, else 4 (int32)."""

    context_parallel_size: int | None = None
    """Context-parallel size (bookkeeping for packed-sequence variants)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig.tokenizer is required")
        missing = [
            name for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(self, name) is None
        ]
        if missing:
            raise ValueError(f"GPTDatasetConfig: {', '.join(missing)} must be set to True or False")
        vocab_size = self.tokenizer.vocab_size
        self.token_dtype_code = None if vocab_size is None else (4 if vocab_size > numpy.iinfo(numpy.uint16).max + 1 else 8)


class GPTDataset(MegatronDataset):
    """GPT samples from one split of an ``IndexedDataset``; items are dicts of tensors."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self._cached_masks: tuple | None = None
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """GPT splits by sequence."""
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Open ``dataset_path`` (``.bin``/``.idx`` prefix)."""
        if is_object_storage_path(dataset_path):
            if config.object_storage_cache_path is None:
                raise ValueError(
                    f"GPTDatasetConfig.object_storage_cache_path (None) must be set to read {dataset_path!r}"
                )
            return IndexedDataset(
                dataset_path,
                multimodal=False,
                mmap=config.mmap_bin_files,
                object_storage_config=ObjectStorageConfig(path_to_idx_cache=config.object_storage_cache_path),
            )
        counts = config.sequences_per_dataset[dataset_path] if config.sequences_per_dataset else None
        return IndexedDataset(
            dataset_path,
            multimodal=False,
            mmap=config.mmap_bin_files,
            sequences_per_dataset=counts,
            dtype_code=config.token_dtype_code if counts else None,
        )

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Sample ``idx`` (``None`` gives a padding sample whose loss mask is all zero)."""
        text = torch.from_numpy(self._query_document_sample_shuffle_indices(0 if idx is None else idx)[0])
        pad = self._pad_token_id
        self._check_token_ids(text, pad, idx)
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = pad

        if self.masks_and_position_ids_are_cacheable and self._cached_masks is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks
            loss_mask = loss_mask.clone()
        else:
            attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
                tokens,
                self.config.tokenizer.eod,
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self._cached_masks = (attention_mask, loss_mask.clone(), position_ids)

        loss_mask[labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """The int64 tokens of sample ``idx`` (padded to full length) and the ids of its documents."""
        extra = int(self.config.add_extra_token_to_sequence)
        idx = self.shuffle_index[idx]
        doc_begin, offset_begin = (int(value) for value in self.sample_index[idx])
        doc_end, offset_end = (int(value) for value in self.sample_index[idx + 1])
        document_ids, parts = [], []
        for position in range(doc_begin, doc_end + 1):
            document = int(self.document_index[position])
            offset = offset_begin if position == doc_begin else 0
            length = offset_end + extra - offset if position == doc_end else None
            document_ids.append(document)
            parts.append(self.dataset.get(document, offset=offset, length=length))
        missing = self.config.sequence_length + extra - sum(len(part) for part in parts)
        if missing > 0:
            parts.append(numpy.full(missing, self._pad_token_id, dtype=numpy.int64))
        return numpy.concatenate(parts, dtype=numpy.int64), numpy.array(document_ids, dtype=numpy.int64)

    def _check_token_ids(self, text: torch.Tensor, pad: int, idx: int | None) -> None:
        """Token ids must lie in ``[0, tokenizer.vocab_size)``: a wrong tokenizer or data file is named here,
        not found later as an index error (or, under tensor parallelism, silently zero embeddings)."""
        vocab_size = getattr(self.config.tokenizer, "vocab_size", None)
        if not isinstance(vocab_size, int) or text.numel() == 0:
            return
        real = text[text != pad]
        if real.numel() and (int(real.max()) >= vocab_size or int(real.min()) < 0):
            bad = int(real.max()) if int(real.max()) >= vocab_size else int(real.min())
            where = getattr(self.dataset, "path_prefix", type(self.dataset).__name__)
            raise ValueError(f"{type(self).__name__} {self.index_split.name} sample {idx} of {where}: token id {bad} "
                             f"is outside the tokenizer's vocabulary (vocab_size {vocab_size}); the data was "
                             "tokenized with another tokenizer")

    def _cache_directory(self) -> str | None:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.config.mock or is_object_storage_path(self.dataset.path_prefix):
            return None  # no local directory beside a remote prefix: build the indices in memory
        return os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")

    def _data_identity(self) -> dict | None:
        prefix = getattr(self.dataset, "path_prefix", None)
        if not prefix or not os.path.isfile(f"{prefix}.idx") or not os.path.isfile(f"{prefix}.bin"):
            return None
        return data_identity(prefix)

    def _build_document_sample_shuffle_indices(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        directory = self._cache_directory()
        cache = None
        if directory:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
            cache = IndexCache(directory, base, ("document_index", "sample_index", "shuffle_index"),
                               source=self._data_identity())
            stale = cache.stale_reason() if cache.complete() else None
            if cache.complete() and stale is None:
                log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices")
                arrays = cache.load()
                return arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
            if stale is not None and distributed.get_rank() == 0:
                logger.warning("Rebuilding the %s %s indices cached in %s: %s", type(self).__name__,
                               self.index_split.name, directory, stale)
            if distributed.get_rank() != 0:
                raise RuntimeError(
                    f"{type(self).__name__} {self.index_split.name} indices are missing from {directory} on rank "
                    f"{distributed.get_rank()}: rank 0 builds them first (build through BlendedMegatronDatasetBuilder, "
                    "which waits on a barrier, and make sure is_built_on_rank is True on rank 0)"
                )
        started = time.time()
        document_index, sample_index, shuffle_index = self._build_indices()
        if cache is not None:
            cache.save(
                self.unique_description,
                {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index},
            )
        log_single_rank(
            logger,
            logging.INFO,
            f"Built the {type(self).__name__} {self.index_split.name} indices in {time.time() - started:.3f} s: "
            f"{sample_index.shape[0] - 1} samples",
        )
        return document_index, sample_index, shuffle_index

    def _build_indices(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        tokens_per_epoch = self._get_num_tokens_per_epoch()
        num_epochs = self._get_num_epochs(tokens_per_epoch)
        separate_final_epoch = False
        if num_epochs > 1:
            samples_before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // sequence_length
            samples_from_final = self.num_samples - samples_before_final
            samples_per_epoch = (tokens_per_epoch - extra) // sequence_length
            if not 0 <= samples_from_final <= samples_per_epoch + 1:
                raise RuntimeError(
                    f"inconsistent epoch arithmetic: {samples_from_final} samples from the final epoch, "
                    f"{samples_per_epoch} per epoch"
                )
            separate_final_epoch = samples_from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)

        random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, random_state, separate_final_epoch)
        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        sample_index = build_sample_idx(
            numpy.asarray(self.dataset.sequence_lengths),
            document_index,
            sequence_length,
            num_epochs,
            tokens_per_epoch,
            drop_last,
            self.config.add_extra_token_to_sequence,
        )
        num_samples = sample_index.shape[0] - 1
        first_range = samples_before_final if separate_final_epoch else num_samples
        shuffle_index = _build_shuffle_index(first_range, num_samples, random_state)
        return document_index, sample_index, shuffle_index

    def _get_num_tokens_per_epoch(self) -> int:
        """Tokens in one pass over the split's documents."""
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices]))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Smallest epoch count that covers ``num_samples`` samples (1 when ``num_samples`` is None)."""
        if self.num_samples is None:
            return 1
        if num_tokens_per_epoch <= 0:
            raise ValueError(
                f"{type(self).__name__} {self.index_split.name}: the split has no tokens, but {self.num_samples} "
                "samples were requested"
            )
        needed = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        return max(1, -(-needed // num_tokens_per_epoch))


def _build_document_index(
    documents: numpy.ndarray, num_epochs: int, random_state: numpy.random.RandomState, separate_final_epoch: bool
) -> numpy.ndarray:
    """``documents`` repeated ``num_epochs`` times as int32, shuffled (the last epoch apart if asked)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, random_state, False)
    last = _build_document_index(documents, 1, random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int, random_state: numpy.random.RandomState) -> numpy.ndarray:
    """Shuffled ``[0, num_samples)`` followed by shuffled ``[num_samples, total_size)`` (uint32 or int64)."""
    dtype = numpy.int64 if total_size >= numpy.iinfo(numpy.uint32).max - 1 else numpy.uint32
    first = numpy.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return numpy.concatenate((first, last))


class MockGPTLowLevelDataset:
    """100000 synthetic sequences (fixed seed 0) with lengths in [1, 4096): ``(arange(n - 1) + 1) % vocab``, then eod."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        generator = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = generator.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        body = (numpy.arange(length - 1, dtype=numpy.int64) + 1) % self.vocab_size
        return numpy.concatenate([body, numpy.array([self.eod_token], dtype=numpy.int64)])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> numpy.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx``."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """``GPTDataset`` over ``MockGPTLowLevelDataset``; needs a config without blends (``config.mock``)."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: str | None,
        indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a mock config (no blend and no blend_per_split)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        """Number of synthetic sequences."""
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        """The synthetic dataset (``dataset_path`` is ignored)."""
        return MockGPTLowLevelDataset(config.tokenizer)
