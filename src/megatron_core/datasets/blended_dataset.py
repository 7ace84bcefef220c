"""``BlendedDataset``: samples drawn from several ``MegatronDataset``s in fixed proportions.

Megatron-Core's ``megatron.core.datasets.blended_dataset``. Two indices map a blended sample to
(dataset, sample in that dataset): ``dataset_index`` (int16) and ``dataset_sample_index`` (int64),
built greedily so the achieved ratios track the weights at every prefix (``helpers``). With
``size=None`` the weights are sample counts and every dataset is used exactly that many times.
The indices are cached like the GPT ones (``<hash>-BlendedDataset-<split>-...``), when
``path_to_cache`` is set.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict

import numpy
import torch

from megatron_core.datasets import distributed
from megatron_core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_core.datasets.helpers import build_blending_indices, build_exhaustive_blending_indices
from megatron_core.datasets.index_cache import IndexCache
from megatron_core.datasets.megatron_dataset import MegatronDataset
from megatron_core.datasets.utils import log_single_rank, normalize

logger = logging.getLogger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """Blend of ``datasets`` (same class and split) by ``weights``; ``size`` samples or, if None, all of them."""

    def __init__(
        self,
        datasets: list[MegatronDataset],
        weights: list[int | float],
        size: int | None,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if not 0 < len(datasets) < 32767:
            raise ValueError(f"BlendedDataset: needs between 1 and 32766 datasets, got {len(datasets)}")
        if any(type(dataset) is not type(datasets[0]) for dataset in datasets):
            raise ValueError("BlendedDataset: all datasets must be of the same class")
        if any(dataset.index_split != datasets[0].index_split for dataset in datasets):
            raise ValueError("BlendedDataset: all datasets must belong to the same split")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"BlendedDataset: weights must be positive, got {list(weights)}")
        if size is None and any(weight != int(weight) for weight in weights):
            raise ValueError(f"BlendedDataset: with size=None the weights are sample counts, got {list(weights)}")
        if len(datasets) == 1:
            log_single_rank(logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset")
        if size is not None:
            weights = normalize(weights)

        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        identifiers: OrderedDict = OrderedDict()
        identifiers["class"] = type(self).__name__
        identifiers["datasets"] = [dataset.unique_identifiers for dataset in datasets]
        identifiers["split"] = self.split.name
        identifiers["weights"] = self.weights
        identifiers["size"] = self.size
        self.unique_description = json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict:
        """``{"dataset_id": i, **datasets[i][j]}`` for the ``(i, j)`` the indices give."""
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _build_indices(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        cache = None
        if self.config.path_to_cache:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
            cache = IndexCache(self.config.path_to_cache, base, ("dataset_index", "dataset_sample_index"))
            if cache.complete():
                arrays = cache.load()
                return arrays["dataset_index"], arrays["dataset_sample_index"]
            if distributed.get_rank() != 0:
                raise RuntimeError(
                    f"BlendedDataset {self.split.name} indices are missing from {self.config.path_to_cache} on rank "
                    f"{distributed.get_rank()}: rank 0 builds them first (build through BlendedMegatronDatasetBuilder)"
                )
        if self.size is not None:
            dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
            build_blending_indices(
                dataset_index, dataset_sample_index, self.weights, len(self.datasets), self.size, False
            )
        else:
            total = int(sum(self.weights))
            dataset_index = numpy.zeros(total, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(total, dtype=numpy.int64)
            build_exhaustive_blending_indices(
                dataset_index, dataset_sample_index, [int(weight) for weight in self.weights], len(self.datasets)
            )
        used, counts = numpy.unique(dataset_index, return_counts=True)
        for dataset_id, count in zip(used, counts):
            available = len(self.datasets[dataset_id])
            if available < count:
                raise IndexError(
                    f"The {self.split.name} blend oversamples dataset {dataset_id} "
                    f"({type(self.datasets[dataset_id]).__name__}): it needs {count} samples but has {available}. "
                    f"Increase the config's mid_level_dataset_surplus (now {self.config.mid_level_dataset_surplus}), "
                    "e.g. two- or ten-fold."
                )
        if cache is not None:
            cache.save(
                self.unique_description,
                {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index},
            )
        return dataset_index, dataset_sample_index
