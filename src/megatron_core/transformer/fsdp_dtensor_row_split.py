"""Cutting a tensor of a ``fsdp_dtensor`` checkpoint into row sections that DCP saves as separate tensors.

A fused parameter (the SwiGLU ``linear_fc1`` ``[gate; up]``, the gated delta net's ``in_proj`` and
``conv1d``) is stored in the ``fsdp_dtensor`` format as one tensor per section along dim 0, so each
section reshards on its own. A plain (replicated) tensor is cut into views. An FSDP2 parameter (a
``DTensor`` whose local tensor is a block of rows, ``torch.chunk`` layout over the data-parallel
mesh) is cut into this rank's rows of each section; those pieces are uneven, so each becomes a
:class:`~megatron_core.dist_checkpointing.strategies.checkpointable.CheckpointableShardedTensor`
that tells DCP its global offset. Every piece is a view of the original storage: a DCP load into
the pieces writes straight into the parameter (or optimizer state).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.dist_checkpointing.mapping import ShardedTensor
from megatron_core.dist_checkpointing.strategies.checkpointable import CheckpointableShardedTensor
from megatron_core.distributed.torch_fully_sharded_data_parallel_checkpoint import (
    is_fsdp_dtensor,
    local_row_range,
)

__all__ = ["local_data", "row_piece_region", "split_rows"]


def _uneven_piece(key: str, data: torch.Tensor, global_shape: tuple[int, ...], row0: int) -> torch.Tensor:
    offset = (row0,) + (0,) * (len(global_shape) - 1)
    sh = ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                       global_shape=tuple(global_shape), global_offset=offset, axis_fragmentations=None)
    return CheckpointableShardedTensor.from_sh_ten(sh)


def split_rows(tensor: torch.Tensor, sizes: list[int], keys: list[str]) -> list[torch.Tensor | None]:
    """``tensor`` cut along dim 0 into sections of ``sizes`` rows, one per key in ``keys``.

    Plain tensors give views; FSDP2 DTensors give this rank's rows of each section as uneven shards
    (``None`` where this rank holds no row of a section). ``ValueError`` when the sizes do not add up.
    """
    if len(sizes) != len(keys):
        raise ValueError(f"split_rows needs one key per section: sizes {sizes}, keys {keys}")
    rows = tensor.shape[0] if tensor.dim() else 0
    if sum(sizes) != rows:
        raise ValueError(f"{keys[0].rsplit('.', 1)[0]}: sections {sizes} add up to {sum(sizes)} rows but the tensor "
                         f"has {rows} (shape {tuple(tensor.shape)})")
    if not is_fsdp_dtensor(tensor):
        if hasattr(tensor, "device_mesh"):
            raise ValueError(f"{keys[0]}: only DTensors sharded along dim 0 on a 1-D mesh (FSDP2) can be split, got "
                             f"placements {tensor.placements}")
        return list(torch.split(tensor, sizes, dim=0))
    start, end = local_row_range(tensor)
    local = tensor._local_tensor
    pieces: list[torch.Tensor | None] = []
    first = 0
    for size, key in zip(sizes, keys):
        lo, hi = max(first, start), min(first + size, end)
        if lo < hi:
            pieces.append(_uneven_piece(key, local[lo - start:hi - start], (size, *tensor.shape[1:]), lo - first))
        else:
            pieces.append(None)
        first += size
    return pieces


def row_piece_region(value: Any) -> tuple[int, int] | None:
    """``[start, end)`` rows of the global tensor that a state-dict value holds locally (``None``: all of it)."""
    if isinstance(value, CheckpointableShardedTensor):
        sh = value._sh_ten
        return sh.global_offset[0], sh.global_offset[0] + sh.local_shape[0]
    if is_fsdp_dtensor(value):
        return local_row_range(value)
    return None


def local_data(value: Any) -> torch.Tensor:
    """The locally held data of a plain tensor, an FSDP2 DTensor or an uneven piece."""
    if isinstance(value, CheckpointableShardedTensor):
        return value._sh_ten.data
    if hasattr(value, "device_mesh"):
        return value._local_tensor
    return value
