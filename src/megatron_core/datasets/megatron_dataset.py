"""``MegatronDataset``: the base of the mid-level datasets (one split of one low-level dataset).

Megatron-Core's ``megatron.core.datasets.megatron_dataset``. Each instance records a
``unique_description`` (JSON of class, path, sample count, split and the config's key attributes)
whose MD5 names its index cache files, so a changed config never reuses stale indices. The pad
id comes from the tokenizer; when the tokenizer has none, or it collides with another special id
(and ``allow_ambiguous_pad_tokens`` is off), -1 is used, which never occurs in real data.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy
import torch

from megatron_core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.utils import Split

LowLevelDataset = IndexedDataset | Iterable

_PAD_TOKEN_ID = -1


def _describe(identifiers: OrderedDict) -> tuple[str, str]:
    description = json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)
    return description, hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()


def _special_ids(tokenizer: Any) -> list[int]:
    try:
        ids = [value for key, value in tokenizer.special_tokens_dict.items() if key != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        ids = []
    if not ids:
        for name in ("eos", "eod"):
            try:
                ids.append(getattr(tokenizer, name))
            except (AttributeError, NotImplementedError, ValueError):
                pass
    return ids


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """One split of a low-level dataset, exposing ``indices`` (the documents it may use)."""

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: str | None,
        indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attribute in self._key_config_attributes():
            self.unique_identifiers[attribute] = getattr(self.config, attribute)
        self.unique_description, self.unique_description_hash = _describe(self.unique_identifiers)

        self._pad_token_id = self._resolve_pad_token_id()

    def _resolve_pad_token_id(self) -> int:
        try:
            pad = self.config.tokenizer.pad
        except Exception:
            return _PAD_TOKEN_ID
        if pad is None:  # megatron_core.tokenizers report an undefined pad as None
            return _PAD_TOKEN_ID
        if pad in _special_ids(self.config.tokenizer):
            warnings.warn(
                "The pad token id in the tokenizer collides with another special token id; "
                + (
                    "it is kept because allow_ambiguous_pad_tokens is set."
                    if self.config.allow_ambiguous_pad_tokens
                    else "pad tokens already in the data will not be masked out."
                ),
                stacklevel=3,
            )
            if not self.config.allow_ambiguous_pad_tokens:
                return _PAD_TOKEN_ID
        return pad

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """Number of elements (documents or sequences) the split fractions divide."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        """Open the low-level dataset at ``dataset_path``."""
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """Config attributes that identify the dataset (they enter the cache hash)."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __getitem__(self, idx: int) -> dict[str, torch.Tensor | numpy.ndarray]:
        """One sample."""
