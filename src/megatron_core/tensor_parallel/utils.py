"""Tensor splitting helpers and vocabulary partitioning for tensor parallelism.

``VocabUtility`` gives each TP rank a contiguous range of vocabulary rows. Megatron-Core requires
the (padded) vocabulary to divide by the TP size; :func:`pad_vocab_size` computes that padding
the way Megatron-LM's training arguments do (a multiple of ``make_vocab_size_divisible_by * TP``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import _gather_along_first_dim


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal pieces along its last dimension."""
    last = tensor.size(-1)
    if last % num_partitions != 0:
        raise ValueError(f"last dimension ({last}) is not divisible by num_partitions ({num_partitions})")
    chunks = torch.split(tensor, last // num_partitions, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This TP rank's equal piece of ``tensor`` flattened to 1-D (a view unless ``new_buffer``)."""
    tp_group = resolve_tp_group(tp_group)
    world_size = get_pg_size(tp_group)
    flat = tensor.reshape(-1)
    if flat.numel() % world_size != 0:
        raise ValueError(
            f"tensor of {flat.numel()} elements cannot be split into {world_size} equal 1-D chunks"
        )
    per_rank = flat.numel() // world_size
    start = get_pg_rank(tp_group) * per_rank
    piece = flat[start : start + per_rank]
    return piece.clone() if new_buffer else piece


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather the 1-D chunks made by :func:`split_tensor_into_1d_equal_chunks` into one 1-D tensor."""
    tp_group = resolve_tp_group(tp_group)
    return _gather_along_first_dim(tensor.reshape(-1), tp_group)


def pad_vocab_size(
    orig_vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """The smallest size >= ``orig_vocab_size`` that is a multiple of ``make_vocab_size_divisible_by * TP``."""
    if orig_vocab_size < 1 or make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"pad_vocab_size needs positive sizes (got orig_vocab_size={orig_vocab_size}, "
            f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, "
            f"tensor_model_parallel_size={tensor_model_parallel_size})"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((orig_vocab_size + multiple - 1) // multiple) * multiple


class VocabUtility:
    """The vocabulary range ``[first, last)`` owned by each tensor-parallel rank."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Range of rank ``rank`` when every rank holds ``per_partition_vocab_size`` rows."""
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        """Range of rank ``rank`` for a vocabulary of ``global_vocab_size`` split over ``world_size`` ranks."""
        if global_vocab_size % world_size != 0:
            raise ValueError(
                f"vocabulary size ({global_vocab_size}) is not divisible by the tensor-parallel size "
                f"({world_size}); pad it with megatron_core.tensor_parallel.pad_vocab_size"
                f"({global_vocab_size}, make_vocab_size_divisible_by, {world_size}) -> "
                f"{pad_vocab_size(global_vocab_size, 1, world_size)} or more"
            )
        per_partition = global_vocab_size // world_size
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
