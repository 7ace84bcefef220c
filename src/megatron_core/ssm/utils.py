"""Checkpoint helpers of the Mamba mixer: store a fused TP-sharded tensor as separately keyed parts.

The mixer's ``in_proj.weight`` holds ``[z, x, B, C, dt]`` of this TP rank stacked along dim 0.
:func:`_split_tensor_factory` stores each part under ``<key>.<name>`` as its own TP-sharded
tensor, so the checkpoint does not depend on the TP size (Megatron-Core's layout).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_core.dist_checkpointing.mapping import ReplicaId, ShardedTensor, ShardedTensorFactory

__all__: list[str] = []


def _split_tensor_factory(orig_sh_ten: ShardedTensor, split_sections: list[int], split_names: list[str],
                          split_dim: int) -> ShardedTensorFactory:
    """A factory storing ``orig_sh_ten``'s local data cut along local ``split_dim`` into named parts.

    Each part keeps the original's sharding on ``split_dim`` (TP rank and size) but covers only its
    own global extent (``section * tp_size``); loading concatenates the parts back.
    """
    if not isinstance(orig_sh_ten, ShardedTensor):
        raise TypeError(f"_split_tensor_factory needs a ShardedTensor, got {type(orig_sh_ten).__name__}")
    if isinstance(split_sections, int) or len(split_sections) != len(split_names):
        raise ValueError(f"split_sections ({split_sections}) and split_names ({split_names}) must be lists "
                         "of the same length")
    template = orig_sh_ten.without_data()
    local = template.local_shape[split_dim]
    if sum(split_sections) != local:
        raise ValueError(f"split sections {split_sections} (sum {sum(split_sections)}) must cover the whole "
                         f"local dimension {split_dim} of {template.key!r} ({local})")
    axis = template.prepend_axis_num + split_dim
    fragments = template.global_shape[axis] // local
    rank = template.global_offset[axis] // local

    @torch.no_grad()
    def build_fn(key: str, data: torch.Tensor, replica_id: ReplicaId, flattened_range: slice | None) -> list:
        if flattened_range is not None:
            raise ValueError(f"{key!r}: splitting a flattened (distributed-optimizer) shard is not supported")
        parts = []
        for piece, size, name in zip(torch.split(data, split_sections, dim=split_dim), split_sections, split_names):
            shape = list(template.global_shape)
            shape[axis] = size * fragments
            offset = list(template.global_offset)
            offset[axis] = size * rank
            parts.append(replace(template, key=f"{key}.{name}", data=piece, dtype=piece.dtype,
                                 local_shape=tuple(piece.shape), global_shape=tuple(shape),
                                 global_offset=tuple(offset), replica_id=replica_id))
        return parts

    def merge_fn(sub_state_dict: list | dict) -> torch.Tensor:
        pieces = list(sub_state_dict.values()) if isinstance(sub_state_dict, dict) else list(sub_state_dict)
        return torch.cat(pieces, dim=split_dim)

    return ShardedTensorFactory(orig_sh_ten.key, orig_sh_ten.data, build_fn, merge_fn, orig_sh_ten.replica_id)
