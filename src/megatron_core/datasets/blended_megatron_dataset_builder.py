"""``BlendedMegatronDatasetBuilder``: build the train/valid/test datasets a config describes.

Megatron-Core's builder (``megatron.core.datasets.blended_megatron_dataset_builder``). Per split:

* one prefix, no weights: one ``cls`` dataset of the requested size;
* several prefixes with weights: each prefix's dataset is built with
  ``ceil(ceil(size * weight) * (1 + mid_level_dataset_surplus))`` samples, then a ``BlendedDataset``
  of ``sum(ceil(size * weight))`` samples on top;
* several prefixes without weights: each dataset covers one epoch and the blend weights are their
  lengths (size capped at their total; size None uses every sample exactly once).

``build()`` must run on every rank: rank 0 builds (and caches) first, the others wait on a barrier
and then load; ranks where ``is_built_on_rank()`` is False get None.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy
import torch

from megatron_core.datasets import distributed
from megatron_core.datasets.blended_dataset import BlendedDataset
from megatron_core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron_core.datasets.megatron_dataset import LowLevelDataset, MegatronDataset
from megatron_core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset
"""The per-prefix dataset class the builder instantiates (``cls``)."""

TopLevelDataset = BlendedDataset | MidLevelDataset
"""What ``build()`` returns per split: a blend, or a single prefix's dataset."""

DistributedDataset = TopLevelDataset | MidLevelDataset | LowLevelDataset | torch.utils.data.Dataset
"""Any dataset the builder may hand to (or build on) a rank."""


def _check_prefixes_exist(config: BlendedMegatronDatasetConfig) -> None:
    """Raise ``FileNotFoundError`` naming every blend prefix without its ``.bin``/``.idx`` pair."""
    blends = [config.blend] if config.blend_per_split is None else config.blend_per_split
    missing: dict[str, list[str]] = {}
    for blend in blends:
        for prefix in [] if blend is None else blend[0]:
            if "://" in prefix or IndexedDataset.exists(prefix):
                continue
            missing[prefix] = [path for path in (get_idx_path(prefix), get_bin_path(prefix)) if not os.path.exists(path)]
    if missing:
        details = "; ".join(f"{prefix} (missing {', '.join(paths)})" for prefix, paths in missing.items())
        raise FileNotFoundError(f"{len(missing)} blend prefix(es) not found before building: {details}")


class BlendedMegatronDatasetBuilder:
    """Builds ``[train, valid, test]`` (entries may be None) from ``config`` with dataset class ``cls``."""

    def __init__(
        self,
        cls: type[MidLevelDataset],
        sizes: list[int | None],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes must give one size (or None) per split (train, valid, test), got {sizes}")
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        log_single_rank(logger, logging.INFO, f"Building {cls.__name__} splits with sizes={sizes} and config={config}")
        if config.mock:
            return
        _check_prefixes_exist(config)
        for split in Split:
            if config.blend_per_split is None:
                blend = config.blend
            else:
                blend = config.blend_per_split[split.value]
                if blend is None:
                    continue
            if sizes[split.value] is None and blend[1] is not None:
                raise ValueError(
                    f"the {split.name} split has blend weights but size None: weights need a requested size "
                    "(give a size, or drop the weights to use every sample once)"
                )

    def build(self) -> list[TopLevelDataset | None]:
        """Build every split; call on all ranks."""
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if isinstance(dataset, BlendedDataset) and dataset.size is not None and dataset.size != len(dataset):
                raise RuntimeError(f"BlendedDataset has {len(dataset)} samples, {dataset.size} were requested")
            if isinstance(dataset, MegatronDataset) and dataset.num_samples is not None and len(dataset) > 0:
                if dataset.num_samples > len(dataset):
                    raise RuntimeError(
                        f"{type(dataset).__name__} has {len(dataset)} samples, {dataset.num_samples} were requested"
                    )
        return datasets

    def _build_blended_dataset_splits(self) -> list[TopLevelDataset | None]:
        if self.config.mock:
            return self._build_megatron_dataset_splits(None, self.config.split_matrix, self.sizes)
        if self.config.blend:
            prefixes, weights = self.config.blend
            return self._build_blend(prefixes, weights, self.config.split_matrix, self.sizes, list(range(len(Split))))
        datasets: list[Any] = [None] * len(Split)
        for i in range(len(Split)):
            blend = self.config.blend_per_split[i]
            if blend is None:
                continue
            split_spoof: list[Any] = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof: list[int | None] = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            prefixes, weights = blend
            if self.config.multiple_validation_sets and i == Split.valid.value and len(prefixes) > 1:
                if self.config.full_validation and sizes_spoof[i] is not None:
                    raise ValueError(
                        f"full_validation needs the valid size None (one full epoch), got {sizes_spoof[i]}"
                    )
                datasets[i] = [
                    self._build_megatron_dataset_splits(prefix, split_spoof, sizes_spoof)[i] for prefix in prefixes
                ]
            else:
                datasets[i] = self._build_blend(prefixes, weights, split_spoof, sizes_spoof, [i])[i]
        return datasets

    def _build_blend(
        self,
        prefixes: list[str],
        weights: list[float] | None,
        split: list[Any],
        sizes: list[int | None],
        split_ids: list[int],
    ) -> list[Any]:
        if weights is not None:
            weights = normalize(weights)
        # Megatron blends a lone weighted prefix of a shared split, but never one of a per-split blend.
        per_split = len(split_ids) == 1
        if len(prefixes) == 1 and (weights is None or per_split):
            return self._build_megatron_dataset_splits(prefixes[0], split, sizes)
        if weights is None:
            buffer_sizes: list[list[int | None]] = [[None] * len(Split) for _ in prefixes]
        else:
            target_sizes = _get_size_per_split_per_dataset(weights, sizes)
            buffer_sizes = _get_size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        megatron_datasets = self._build_megatron_datasets_parallel(prefixes, split, buffer_sizes)
        blended: list[Any] = [None] * len(Split)
        for i in split_ids:
            if split[i] is None:
                continue
            if weights is not None:
                blend_weights = weights
                size = sum(target[i] for target in target_sizes)
            else:
                lengths = [len(dataset) if dataset is not None else 0 for dataset in megatron_datasets[i]]
                blend_weights = lengths
                size = None if sizes[i] is None else min(sizes[i], sum(lengths))
            blended[i] = self.build_generic_dataset(
                BlendedDataset, self.is_built_on_rank, True, megatron_datasets[i], blend_weights, size, self.config
            )
        return blended

    def _build_megatron_datasets_parallel(
        self, prefixes: list[str], split: list[Any], sizes_per_dataset: list[list[int | None]]
    ) -> list[list[MegatronDataset | None]]:
        """Each prefix's split datasets (rank 0 first, then the other ranks after a barrier)."""

        def build_all() -> list[list[MegatronDataset | None]]:
            per_split: list[list[MegatronDataset | None]] = [[] for _ in Split]
            workers = max(1, self.config.num_dataset_builder_threads)
            with ThreadPoolExecutor(max_workers=workers) as executor:
                futures = [
                    executor.submit(self._build_megatron_dataset_splits, prefix, split, sizes, False)
                    for prefix, sizes in zip(prefixes, sizes_per_dataset)
                ]
                for future in futures:
                    for j, dataset in enumerate(future.result()):
                        per_split[j].append(dataset)
            return per_split

        if not distributed.is_initialized():
            return build_all()
        result = build_all() if distributed.get_rank() == 0 else None
        distributed.barrier()
        if distributed.get_rank() != 0:
            result = build_all()
        return result

    def _build_megatron_dataset_splits(
        self, dataset_path: str | None, split: list[Any], sizes: list[int | None], synchronize_ranks: bool = True
    ) -> list[MegatronDataset | None]:
        """Every split of one low-level dataset (None for splits with no share)."""
        if distributed.is_initialized() and not self.is_built_on_rank():
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    distributed.barrier()
            return [None] * len(Split)
        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        datasets: list[MegatronDataset | None] = []
        for i, split_name in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            begin = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = numpy.arange(start=begin, stop=end, step=1, dtype=numpy.int32)
            datasets.append(
                self.build_generic_dataset(
                    self.cls,
                    self.is_built_on_rank,
                    synchronize_ranks,
                    low_level_dataset,
                    dataset_path,
                    indices,
                    sizes[i],
                    split_name,
                    self.config,
                )
            )
        return datasets

    @staticmethod
    def build_generic_dataset(
        cls: type | Callable, is_built_on_rank: Callable[[], bool], synchronize_ranks: bool, *args: Any
    ) -> Any:
        """``cls(*args)``: on rank 0 first, then (after a barrier) on the other ranks that build."""
        if not distributed.is_initialized():
            return cls(*args)
        rank = distributed.get_rank()
        dataset = None
        if rank == 0 and is_built_on_rank():
            try:
                dataset = cls(*args)
            except OSError as error:
                raise RuntimeError(
                    "Failed to write dataset indices to the cache directory; set path_to_cache in the config "
                    "to a directory you can write to"
                ) from error
        if synchronize_ranks:
            distributed.barrier()
        if rank != 0 and is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _get_size_per_split_per_dataset(
    normalized_weights: list[float], target_size_per_split: list[int | None], surplus: float = 0.0
) -> list[list[int]]:
    """Samples to request from each dataset per split: ``ceil(ceil(size * weight) * (1 + surplus))``."""
    if not numpy.isclose(sum(normalized_weights), 1.0):
        raise ValueError(f"weights {normalized_weights} must be normalised")
    return [
        [
            None if size is None else int(math.ceil(math.ceil(size * weight) * (1 + surplus)))
            for size in target_size_per_split
        ]
        for weight in normalized_weights
    ]
