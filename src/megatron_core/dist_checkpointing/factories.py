"""Factories for fused tensors whose per-rank layout depends on tensor parallelism.

A SwiGLU ``linear_fc1`` weight on each TP rank is ``[gate_r; up_r]`` (two local halves stacked
along dim 0). Stored as-is, the global tensor would interleave gate and up pieces by TP rank, so
a checkpoint could not be loaded under another TP size. The factory stores it as the
TP-independent ``[gate_0 .. gate_{T-1}; up_0 .. up_{T-1}]``: each local chunk ``i`` becomes its
own shard at offset ``sum(global chunk sizes before i) + tp_rank * local_chunk_size``, and
``merge_fn`` concatenates the loaded chunks back. The same works for any concatenation of
TP-sharded parts (e.g. a ``[q; k; v]`` layout, with unequal chunk sizes).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import ReplicaId, ShardedTensor, ShardedTensorFactory


def apply_fused_chunks_sharded_factory(original_sh_ten: ShardedTensor, local_chunk_sizes: list[int],
                                       tp_axis: int = 0) -> ShardedTensorFactory:
    """Turn a TP-sharded ShardedTensor whose local data is a concatenation of chunks into a factory.

    ``local_chunk_sizes`` are the chunk sizes along local axis ``tp_axis``; the TP rank and size
    are read from the sharded tensor's offset and fragmentation on that axis.
    """
    axis = original_sh_ten.prepend_axis_num + tp_axis
    local_size = original_sh_ten.local_shape[tp_axis]
    if sum(local_chunk_sizes) != local_size:
        raise CheckpointingException(
            f"{original_sh_ten.key!r}: chunk sizes {local_chunk_sizes} do not add up to local size {local_size}"
        )
    tp_size = original_sh_ten.global_shape[axis] // local_size
    tp_rank = original_sh_ten.global_offset[axis] // local_size
    template = original_sh_ten.without_data()

    def build_fn(key: str, data: torch.Tensor, replica_id: ReplicaId, flattened_range: slice | None) -> list:
        shards = []
        region_start = 0
        for chunk, size in zip(torch.split(data, local_chunk_sizes, dim=tp_axis), local_chunk_sizes):
            offset = list(template.global_offset)
            offset[axis] = region_start + tp_rank * size
            shards.append(replace(template, key=key, data=chunk, dtype=chunk.dtype, local_shape=tuple(chunk.shape),
                                  global_offset=tuple(offset), replica_id=replica_id))
            region_start += size * tp_size
        return shards

    def merge_fn(sub_state_dict: list) -> torch.Tensor:
        return torch.cat(list(sub_state_dict.values()) if isinstance(sub_state_dict, dict) else sub_state_dict,
                         dim=tp_axis)

    return ShardedTensorFactory(original_sh_ten.key, original_sh_ten.data, build_fn, merge_fn,
                                original_sh_ten.replica_id)


def apply_swiglu_sharded_factory(original_sh_ten: ShardedTensor, sharded_offsets: tuple = ()) -> ShardedTensorFactory:
    """The factory for a SwiGLU ``linear_fc1`` weight or bias: two equal chunks, gate then up."""
    local_size = original_sh_ten.local_shape[0]
    if local_size % 2:
        raise CheckpointingException(f"{original_sh_ten.key!r}: SwiGLU fc1 local size {local_size} is odd")
    return apply_fused_chunks_sharded_factory(original_sh_ten, [local_size // 2, local_size // 2], tp_axis=0)
