"""ShardedTensors as tensors PyTorch DCP can save and load directly (``torch.distributed.checkpoint``).

DCP asks a tensor subclass that implements its checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) where its pieces lie in the global tensor.
:class:`CheckpointableShardedTensor` answers from a :class:`~megatron_core.dist_checkpointing.mapping.\
ShardedTensor`'s offsets, so ``dcp.save({"w": CheckpointableShardedTensor.from_sh_ten(sh)}, ...)`` writes
this rank's shard of the global tensor, and ``dcp.load`` fills the shard's ``data`` in place.
:class:`LocalShardsContainer` carries several shards of one global tensor held by one rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_core.dist_checkpointing.mapping import ShardedTensor


def _no_tensor_ops(cls: type) -> None:
    raise NotImplementedError(f"{cls.__name__}.__torch_dispatch__ not implemented. {cls.__name__} shouldn't be "
                              "used with Tensor operations.")


class CheckpointableShardedTensor(torch.Tensor):
    """A data-less tensor of the global shape standing for one ShardedTensor in a DCP state dict.

    It supports no tensor operations; DCP reads and writes the wrapped shard's ``data``.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(sh_ten.global_shape))

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor) -> None:
        self._data = data
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        """Wrap ``sh_ten`` (which must carry its data)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise TypeError(f"expected a ShardedTensor, got {type(sh_ten).__name__}")
        return cls(sh_ten.data, sh_ten)

    def _chunk(self) -> ChunkStorageMetadata:
        sh = self._sh_ten
        if sh.prepend_axis_num or tuple(sh.data.shape) != sh.local_shape:
            raise ValueError(f"ShardedTensor {sh.key!r}: DCP needs local data of local_shape and no prepended axes")
        return ChunkStorageMetadata(offsets=torch.Size(sh.global_offset), sizes=torch.Size(sh.local_shape))

    def __create_write_items__(self, fqn: str, obj: Any, index: int | None = None) -> list[WriteItem]:
        """One DCP write item: this shard's chunk of the global tensor ``fqn``."""
        chunk = self._chunk()
        return [WriteItem(
            index=MetadataIndex(fqn, chunk.offsets, index), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(self._sh_ten.data),
                                        size=torch.Size(self._sh_ten.global_shape)),
        )]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The chunk this shard covers (what a load must read)."""
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The shard's data (read from when saving, written into when loading)."""
        return self._sh_ten.data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _no_tensor_ops(cls)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(torch.Tensor):
    """Several :class:`CheckpointableShardedTensor` shards of one global tensor, under one DCP key."""

    @staticmethod
    def __new__(cls, local_shards: list[torch.Tensor]) -> LocalShardsContainer:
        if not local_shards:
            raise ValueError("LocalShardsContainer needs at least one shard")
        return torch.Tensor._make_wrapper_subclass(cls, local_shards[0].size())

    def __init__(self, local_shards: list[torch.Tensor]) -> None:
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise TypeError(f"LocalShardsContainer holds CheckpointableShardedTensors, got {type(shard).__name__}")
        self._local_shards = list(local_shards)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """The write items of every shard (each shard's position as DCP's lookup hint)."""
        return [item for i, shard in enumerate(self._local_shards)
                for item in shard.__create_write_items__(fqn, shard, index=i)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The chunks of every shard."""
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The data of the shard at ``index.offset`` (``index.index`` tried first)."""
        if index.offset is None:
            raise ValueError(f"Cannot lookup {index.fqn} for a LocalShardsContainer without an offset")
        shards = self._local_shards
        hint = index.index
        if hint is not None and hint < len(shards) and torch.Size(shards[hint]._sh_ten.global_offset) == index.offset:
            return shards[hint].__get_tensor_shard__(index)
        for shard in shards:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard.__get_tensor_shard__(index)
        raise ValueError(f"Could not find shard at '{index.offset}' for FQN: '{index.fqn}'")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _no_tensor_ops(cls)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._local_shards!r})"


__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]
