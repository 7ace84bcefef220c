"""Translate Megatron-style shards into PyTorch Distributed Checkpoint (DCP) write and read items.

A :class:`ShardedTensor` becomes one DCP chunk of the global tensor ``key`` (offsets and sizes
over every global axis, prepended axes included, where the local size is 1). A
:class:`ShardedObject` becomes a byte blob stored under its ``unique_key``. Loading asks DCP's
resharding helper for the byte ranges that overlap each requested chunk, which is what lets a
checkpoint written under one parallel layout load under another.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor
from megatron_core.dist_checkpointing.safe_load import torch_load_safe


def stage_tensor(t: torch.Tensor, clone: bool) -> torch.Tensor:
    """A CPU tensor holding ``t``'s values; a private copy when ``clone`` (async saves)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    return t.clone() if clone else t


class ShardsSavePlanner(DefaultSavePlanner):
    """DCP save planner whose local plan comes from Megatron shards instead of a flat state dict.

    Duplicate items (replicas, in fully parallel mode) are deduplicated by DCP's planner, which
    assigns each to the rank with the least bytes planned so far.
    """

    def __init__(self, shards: list[ShardedBase], clone: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False)
        self._items: list[WriteItem] = []
        self._data: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for sh in shards:
            if isinstance(sh, ShardedTensor):
                offsets = torch.Size(sh.global_offset)
                sizes = torch.Size(sh.chunk_sizes())
                self._items.append(WriteItem(
                    index=MetadataIndex(sh.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=sh.dtype),
                        size=torch.Size(sh.global_shape),
                    ),
                ))
                if sh.data is None:
                    raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
                self._data[(sh.key, tuple(offsets))] = stage_tensor(sh.data, clone).reshape(sizes)
            else:
                self._items.append(WriteItem(index=MetadataIndex(sh.unique_key), type=WriteItemType.BYTE_IO))
                buffer = io.BytesIO()
                torch.save([sh.data], buffer)  # megatron-core's encoding: a list of this rank's payloads
                self._data[(sh.unique_key, None)] = buffer

    def set_up_planner(self, state_dict: Any = None, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        offset = tuple(write_item.index.offset) if write_item.index.offset is not None else None
        value = self._data[(write_item.index.fqn, offset)]
        if isinstance(value, io.BytesIO):
            return io.BytesIO(value.getbuffer())
        return value

    def planned_bytes(self) -> int:
        """Bytes of tensor data this rank has staged for writing."""
        return sum(v.numel() * v.element_size() for v in self._data.values() if isinstance(v, torch.Tensor))


class ShardsLoadPlanner(LoadPlanner):
    """DCP load planner that reads into fresh buffers, one per requested shard.

    Nothing the caller owns is written: on success :meth:`results` returns the loaded values,
    so a failing load never leaves a model half-updated.
    """

    def __init__(self, shards: list[ShardedBase], metadata: Metadata) -> None:
        self.metadata = metadata
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._objects: dict[str, Any] = {}
        self._requests: list[ReadItem] = []
        for sh in shards:
            if isinstance(sh, ShardedTensor):
                self._plan_tensor(sh)
            else:
                self._requests.append(ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=MetadataIndex(sh.unique_key), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex(sh.unique_key), storage_offsets=torch.Size([0]),
                    lengths=torch.Size([0]),
                ))

    def _plan_tensor(self, sh: ShardedTensor) -> None:
        md = self.metadata.state_dict_metadata[sh.key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointingException(f"key {sh.key!r} is not a tensor in the checkpoint")
        sizes = sh.chunk_sizes()
        key = (sh.key, tuple(sh.global_offset))
        if key in self._buffers:
            return
        if sh.allow_shape_mismatch and sh.data is not None:
            buffer = sh.data.detach().to("cpu", copy=True).reshape(sizes)
        else:
            buffer = torch.empty(sizes, dtype=sh.dtype)
        self._buffers[key] = buffer
        chunk = ChunkStorageMetadata(offsets=torch.Size(sh.global_offset), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(sh.key, md, [chunk])
        wanted = 1
        for off, size, saved in zip(sh.global_offset, sizes, md.size):
            wanted *= max(0, min(off + size, saved) - off)
        got = sum(math.prod(item.lengths) for item in items)
        if got != wanted:
            raise CheckpointingException(
                f"key {sh.key!r}: the checkpoint holds {got} of the {wanted} elements requested at offset "
                f"{tuple(sh.global_offset)} size {tuple(sizes)}"
            )
        self._requests.extend(items)

    def set_up_planner(self, state_dict: Any = None, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._requests)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        payload = torch_load_safe(value, f"object {read_item.dest_index.fqn!r}")
        # megatron-core (and megatron_core since it matched) stores ``[data]``; older megatron_core stored ``data``
        if isinstance(payload, list) and len(payload) == 1:
            payload = payload[0]
        self._objects[read_item.dest_index.fqn] = payload

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        buffer = self._buffers[(index.fqn, tuple(index.offset))]
        view = buffer
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Data was copied into a view of the buffer; nothing to do."""

    def loaded_tensor(self, sh: ShardedTensor) -> torch.Tensor:
        """The loaded local shard of ``sh`` (``local_shape``, on ``sh.data``'s device if it had data)."""
        t = self._buffers[(sh.key, tuple(sh.global_offset))].reshape(sh.local_shape)
        if sh.data is not None and sh.data.device.type != "cpu":
            t = t.to(sh.data.device)
        return t

    def loaded_object(self, sh: ShardedObject) -> Any:
        """The loaded ShardedObject payload."""
        return self._objects[sh.unique_key]
