"""DTensors whose shards have arbitrary sizes, made savable by PyTorch DCP (0.19's ``megatron_fsdp.uneven_dtensor``).

A DTensor built with ``DTensor.from_local(local, mesh, [Shard(d)], shape=...)`` may hold shards of any
size on each rank (Megatron-FSDP cuts parameters at bucket boundaries, not ``torch.chunk``'s). DTensor
itself assumes ``torch.chunk`` sizes when DCP asks where a shard lies, so such a tensor would be saved at
wrong offsets. :func:`update_uneven_dtensor_chunk_metadata` gathers every rank's local shape over the
sharded mesh dimensions (collective), derives this rank's true offset, and attaches DCP's hooks
(``__create_chunk_list__``, ``__create_write_items__``) to the DTensor's local tensor, which DTensor
consults first. :func:`preprocess_state_dict_for_uneven_dtensor` does that for every DTensor of a nested
state dict, in sorted key order so all ranks run the same collectives.

Nesting of several mesh dimensions over one tensor dimension: a ``_StridedShard`` dimension (FSDP
applied after tensor parallelism) is the innermost piece, then plain ``Shard`` dimensions from the last
mesh dimension to the first (DTensor's left-to-right nesting). Megatron-Core 0.19 walks the plain
dimensions first to last, which agrees whenever at most one plain ``Shard`` cuts a tensor dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "filter_unflattened_state_dict",
    "gather_and_compute_chunk_metadata",
    "get_unflattened_state_dict",
    "preprocess_state_dict_for_uneven_dtensor",
    "uneven_dtensor_to_full_tensor",
    "update_uneven_dtensor_chunk_metadata",
    "validate_uneven_dtensor",
]


def _is_shard(placement: Any) -> bool:
    return isinstance(placement, (Shard, _StridedShard))


def _inner_to_outer_mesh_dims(dtensor: DTensor) -> list[int]:
    """Mesh dimensions in the order their pieces nest, innermost first (see the module docstring)."""
    strided = [i for i, p in enumerate(dtensor.placements) if isinstance(p, _StridedShard)]
    if len(strided) > 1:
        raise ValueError(f"DTensor placements {dtensor.placements}: more than one _StridedShard "
                         f"(mesh dimensions {strided}) is not supported")
    for i, p in enumerate(dtensor.placements):
        if not (_is_shard(p) or isinstance(p, Replicate)):
            raise ValueError(f"DTensor placements {dtensor.placements}: mesh dimension {i} has {p}; only Shard, "
                             "_StridedShard and Replicate are supported")
    plain = [i for i in reversed(range(len(dtensor.placements))) if i not in strided]
    return strided + plain


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """Offsets and sizes of this rank's shard of ``dtensor`` in the global tensor (collective over its mesh).

    Every rank of the mesh must call it for the same DTensor. ``ValueError`` for a ``Partial`` placement or
    more than one ``_StridedShard``.
    """
    local_shape = list(dtensor.to_local().shape)
    offsets = [0] * len(local_shape)
    piece_shape = list(local_shape)  # shape of the piece this rank's group covers so far
    for mesh_dim in _inner_to_outer_mesh_dims(dtensor):
        placement = dtensor.placements[mesh_dim]
        if not _is_shard(placement):
            continue
        group = dtensor.device_mesh.get_group(mesh_dim)
        shapes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shapes, piece_shape, group=group)
        d = placement.dim
        offsets[d] += sum(s[d] for s in shapes[:dist.get_rank(group)])
        piece_shape[d] = sum(s[d] for s in shapes)
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local_shape))


def _write_items_fn(chunk: ChunkStorageMetadata) -> Callable[[str, Any], list[WriteItem]]:
    def create_write_items(fqn: str, tensor: Any) -> list[WriteItem]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0:
            return []  # this rank holds nothing of the tensor
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local),
                                                      size=tensor.size()))]

    return create_write_items


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> None:
    """Attach DCP's chunk and write-item hooks with this rank's true offset to ``dtensor``'s local tensor.

    Collective over the DTensor's mesh (see :func:`gather_and_compute_chunk_metadata`). Afterwards
    ``dtensor.__create_chunk_list__()`` returns that chunk and a DCP save writes this rank's shard there.
    """
    chunk = gather_and_compute_chunk_metadata(dtensor)
    local = dtensor._local_tensor
    local.__create_chunk_list__ = lambda: [chunk]
    local.__create_write_items__ = _write_items_fn(chunk)


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """``ValueError`` unless this rank's shard lies inside the global shape and the shards reach both ends
    of every dimension (collective over the mesh)."""
    chunk = gather_and_compute_chunk_metadata(dtensor)
    shape = tuple(dtensor.shape)
    if any(o < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)):
        raise ValueError(f"uneven DTensor: shard at offsets {tuple(chunk.offsets)} of sizes {tuple(chunk.sizes)} "
                         f"exceeds the global shape {shape} (placements {dtensor.placements})")
    # Per dimension: does some rank start at 0, does some rank end at the global size.
    touched = torch.tensor([[o == 0, o + s == n] for o, s, n in zip(chunk.offsets, chunk.sizes, shape)],
                           dtype=torch.int32, device=dtensor.to_local().device).reshape(len(shape), 2)
    for mesh_dim, placement in enumerate(dtensor.placements):
        if _is_shard(placement):
            dist.all_reduce(touched, op=dist.ReduceOp.MAX, group=dtensor.device_mesh.get_group(mesh_dim))
    if not bool(touched.all()):
        raise ValueError(f"uneven DTensor of shape {shape}: the shards do not reach both ends of every dimension "
                         f"(rank shard at offsets {tuple(chunk.offsets)}, sizes {tuple(chunk.sizes)}; the local "
                         "shapes do not add up to the global shape)")


def filter_unflattened_state_dict(state_dict: dict, key_chain: list | None = None,
                                  visit_condition: Callable[[Any], bool] = lambda x: False) -> list[list]:
    """Key paths (lists of keys from the top) of the values in nested dict ``state_dict`` that satisfy
    ``visit_condition``; nested dicts are walked, other values tested."""
    prefix = list(key_chain or [])
    paths: list[list] = []
    for key, value in state_dict.items():
        if isinstance(value, dict):
            paths += filter_unflattened_state_dict(value, prefix + [key], visit_condition)
        elif visit_condition(value):
            paths.append(prefix + [key])
    return paths


def get_unflattened_state_dict(state_dict: dict, key_chain: list | None = None) -> Any:
    """The value at key path ``key_chain`` of nested dict ``state_dict``; ``KeyError`` naming the path if absent."""
    current: Any = state_dict
    for key in key_chain or []:
        if not isinstance(current, dict) or key not in current:
            raise KeyError(f"Key {key_chain} not found in state_dict")
        current = current[key]
    return current


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
    """Make every DTensor of nested dict ``state_dict`` save and load through DCP at its true offsets.

    Calls :func:`update_uneven_dtensor_chunk_metadata` on each DTensor, in sorted key-path order
    (collective: every rank must pass a state dict with the same DTensor paths). Modifies the DTensors'
    local tensors in place and returns ``state_dict`` itself.
    """
    paths = filter_unflattened_state_dict(state_dict, visit_condition=lambda x: isinstance(x, DTensor))
    for path in sorted(paths, key=lambda p: [str(k) for k in p]):
        update_uneven_dtensor_chunk_metadata(get_unflattened_state_dict(state_dict, path))
    return state_dict


def uneven_dtensor_to_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The whole global tensor of a (possibly unevenly) sharded ``dtensor`` on every rank (collective).

    ``TypeError`` if ``dtensor`` is not a DTensor. Attaches the chunk metadata first if it is missing.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"uneven_dtensor_to_full_tensor needs a DTensor, got {type(dtensor).__name__}")
    if not hasattr(dtensor._local_tensor, "__create_chunk_list__"):
        update_uneven_dtensor_chunk_metadata(dtensor)
    (chunk,) = dtensor.__create_chunk_list__()
    local = dtensor.to_local()
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = [(tuple(chunk.offsets), local)]
    for mesh_dim, placement in enumerate(dtensor.placements):
        if not _is_shard(placement):
            continue
        group = dtensor.device_mesh.get_group(mesh_dim)
        layouts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(layouts, [(o, tuple(t.shape)) for o, t in pieces], group=group)
        numels = [sum(torch.Size(s).numel() for _, s in layout) for layout in layouts]
        # Padded to the largest rank's length: gloo's all_gather needs equal sizes.
        flat = local.new_zeros(max(numels))
        torch.cat([t.reshape(-1) for _, t in pieces], out=flat[:sum(t.numel() for _, t in pieces)])
        gathered = [flat.new_empty(len(flat)) for _ in numels]
        dist.all_gather(gathered, flat, group=group)
        pieces = []
        for layout, buf in zip(layouts, gathered):
            start = 0
            for offset, shape in layout:
                n = torch.Size(shape).numel()
                pieces.append((offset, buf[start:start + n].view(shape)))
                start += n
    full = local.new_zeros(dtensor.shape)
    for offset, piece in pieces:
        full[tuple(slice(o, o + s) for o, s in zip(offset, piece.shape))] = piece
    return full
