"""Megatron's pretraining batch samplers and ``build_pretraining_data_loader``.

Both samplers yield micro-batches of sample indices for one data-parallel rank and resume from
``consumed_samples`` (the global count of samples already trained on), so a restarted run sees
exactly the batches it would have seen. ``MegatronPretrainingSampler`` walks the dataset in order,
rank ``r`` taking slice ``[r*mbs, (r+1)*mbs)`` of every global micro-batch of ``mbs * dp`` samples.
``MegatronPretrainingRandomSampler`` reshuffles per epoch with a torch generator seeded by the
epoch number; with ``data_sharding`` each rank draws from its own contiguous bucket.
These follow Megatron-LM's ``megatron/training/datasets/data_samplers.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int, rank: int, size: int) -> None:
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: total_samples is {total_samples}")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must be positive")
    if size <= 0 or not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank ({rank}) must be in [0, data_parallel_size ({size}))")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples ({consumed_samples}) must be >= 0")


class MegatronPretrainingSampler:
    """In-order micro-batches for one DP rank, starting after ``consumed_samples``."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left to consume: consumed_samples ({consumed_samples}) >= {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self) -> tuple[int, int]:
        """This rank's slice of a global micro-batch."""
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        start, end = self.get_start_end_idx()
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                yield batch[start:end]
                batch = []
        if batch and not self.drop_last:
            yield batch[start:end]


class MegatronPretrainingRandomSampler:
    """Shuffled micro-batches for one DP rank (Megatron's "cyclic" loader); the last partial global batch is dropped."""

    def __init__(
        self,
        dataset: Any,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool,
    ) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(
                f"total_samples ({total_samples}) is smaller than one global micro-batch "
                f"({micro_batch_size} x {data_parallel_size})"
            )

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        if current_epoch_samples % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(
                f"consumed_samples ({self.consumed_samples}) must be a multiple of micro_batch_size x "
                f"data_parallel_size ({self.micro_batch_times_data_parallel_size}) within an epoch"
            )
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        generator = torch.Generator()
        generator.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            order = torch.randperm(bucket_size, generator=generator).tolist()
            indices = [start + x for x in order[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            order = torch.randperm(full_bucket_size, generator=generator).tolist()
            indices = order[current_epoch_samples:][self.data_parallel_rank :: self.data_parallel_size]
        batch: list[int] = []
        for idx in indices:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def build_pretraining_data_loader(
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int | None = None,
    data_parallel_size: int | None = None,
    dataloader_type: str = "single",
    num_workers: int = 0,
    data_sharding: bool = True,
    drop_last: bool = True,
    pin_memory: bool = False,
    collate_fn: Callable | None = None,
) -> torch.utils.data.DataLoader | None:
    """A ``DataLoader`` over ``dataset`` with Megatron's sampler (``"single"`` in order, ``"cyclic"`` shuffled).

    The DP rank and size default to ``parallel_state``'s when it is initialised, else 0 and 1.
    ``dataloader_type="external"`` returns the dataset itself (it is already an iterable loader).
    Returns None for a None dataset.
    """
    if dataset is None:
        return None
    if data_parallel_rank is None or data_parallel_size is None:
        from megatron_core import parallel_state

        initialized = parallel_state.model_parallel_is_initialized()
        if data_parallel_rank is None:
            data_parallel_rank = parallel_state.get_data_parallel_rank() if initialized else 0
        if data_parallel_size is None:
            data_parallel_size = parallel_state.get_data_parallel_world_size() if initialized else 1
    if dataloader_type == "single":
        sampler: Any = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, drop_last
        )
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            dataset, len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
            data_sharding,
        )
    elif dataloader_type == "external":
        return dataset
    else:
        raise ValueError(f"dataloader_type {dataloader_type!r} must be 'single', 'cyclic' or 'external'")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
        persistent_workers=num_workers > 0,
    )
