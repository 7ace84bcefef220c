"""Megatron-Core 0.19's translation of a sharded state dict into a PyTorch DCP state dict, and the DCP
planners for it (``strategies.torch``'s ``flatten_state_dict``, ``mcore_to_pyt_state_dict``,
``sharded_tensor_to_torch_sharded_tensor``, ``MCoreSavePlanner``, ``MCoreLoadPlanner``).

They let a sharded state dict go through ``torch.distributed.checkpoint.save``/``load`` directly: tensors
become :class:`~.checkpointable.CheckpointableShardedTensor` (several shards of a key on one rank: a
:class:`~.checkpointable.LocalShardsContainer`), or, for shards with prepended axes, torch's legacy
``ShardedTensor``; objects become ``io.BytesIO`` of ``torch.save([payloads])``. Files written this way have
the layout :mod:`.torch_dist` writes and reads (which drives DCP's layers itself instead).

Not here: Transformer Engine FP8 tensors' streaming dequantization in ``MCoreLoadPlanner`` (no TE
tensors in this library) and the legacy 1-D flattened layout (``flattened_range``), which is refused.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import product
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor import TensorProperties as ShardTensorProperties
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
)
from megatron_core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
)


def flatten_state_dict(state_dict: ShardedStateDict) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``(flat dict keyed by dotted paths, dotted path -> original key path)``, as DCP's ``flatten_state_dict``
    but with sharded leaves terminal as tensors are (lists are entered only when they hold such leaves)."""
    flattened: dict[str, Any] = {}
    mappings: dict[str, tuple] = {}

    def flat_copy(path: tuple, value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in flattened:
            raise ValueError(f"duplicated flatten key {fqn}")
        flattened[fqn] = value
        mappings[fqn] = path

    traverse_state_dict(state_dict, flat_copy, lambda x: isinstance(x, (torch.Tensor, ShardedBase)))
    return flattened, mappings


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sharded_tensor_to_torch_sharded_tensor(sh_tens: list[ShardedTensor], rank: int | None = None,
                                           load_legacy_1d_flatten_tensors: bool = False) -> TorchShardedTensor:
    """torch's (legacy) ``ShardedTensor`` holding this rank's shards of one key; no communication.

    The global layout is the regular grid of ``axis_fragmentations`` (required); prepended axes become
    leading size-1 axes of each local shard. The data-less ``ShardedTensor`` is kept as ``.mcore_sh_ten``.
    """
    if load_legacy_1d_flatten_tensors or any(sh.flattened_range is not None for sh in sh_tens):
        raise CheckpointingException(
            f"{sh_tens[0].key!r}: flattened_range (legacy 1-D flattened tensors) is not supported")
    my_rank, world = _world()
    rank = my_rank if rank is None else rank
    first = sh_tens[0]
    if first.axis_fragmentations is None:
        raise CheckpointingException(f"{first.key!r}: a torch ShardedTensor needs a regular grid "
                                     "(axis_fragmentations)")
    by_offset: dict[tuple, list[ShardedTensor]] = {}
    local_shards = []
    for sh in sh_tens:
        sh.data = sh.data.contiguous().view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        by_offset.setdefault(tuple(sh.global_offset), []).append(sh)
        local_shards.append(Shard.from_tensor_and_offsets(sh.data, list(sh.global_offset), rank))
    device = first.data.device.type
    chunk_shape = tuple(first.data.shape)
    metadata = []
    for fragment in product(*map(range, first.axis_fragmentations)):
        offset = tuple(i * n for i, n in zip(fragment, chunk_shape))
        if offset in by_offset:
            metadata.extend(ShardMetadata(list(offset), list(sh.data.shape), f"rank:{rank}/{device}")
                            for sh in by_offset[offset])
        else:  # another rank's chunk: torch discards this placement, it only needs to be a different rank
            metadata.append(ShardMetadata(list(offset), list(chunk_shape), f"rank:{(rank + 1) % world}/{device}"))
    properties = ShardTensorProperties(dtype=first.data.dtype, layout=first.data.layout, requires_grad=False,
                                       memory_format=torch.contiguous_format, pin_memory=False)
    result = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, ShardedTensorMetadata(metadata, torch.Size(first.global_shape), properties), process_group=None)
    result.mcore_sh_ten = first.without_data()
    return result


def mcore_to_pyt_state_dict(state_dict: dict[str, list[ShardedBase]], is_loading: bool = False,
                            init_device: torch.device | str = "cpu",
                            load_legacy_1d_flatten_tensors: bool = False) -> dict[str, Any]:
    """A DCP state dict from ``{storage key: [this rank's shards of it]}`` (tensors or objects).

    When loading, a shard without data gets an empty (``allow_shape_mismatch``: zero) buffer on
    ``init_device`` for DCP to fill; a shard allowing a shape mismatch is zeroed first. Saving needs data.
    """
    pyt: dict[str, Any] = {}
    for key, shards in state_dict.items():
        if isinstance(shards[0], ShardedTensor):
            pyt[key] = _to_dcp_tensor(shards, is_loading, init_device, load_legacy_1d_flatten_tensors)
        else:
            if not all(isinstance(sh, ShardedObject) for sh in shards):
                raise CheckpointingException(f"{key!r}: tensors and objects mixed under one key")
            buffer = io.BytesIO()
            torch.save([sh.data for sh in shards], buffer)
            pyt[key] = buffer
    return pyt


def _to_dcp_tensor(shards: list[ShardedTensor], is_loading: bool, init_device: torch.device | str,
                   legacy_1d: bool) -> Any:
    for sh in shards:
        if sh.data is None:
            if not is_loading:
                raise CheckpointingException(f"`data` attr is None for {sh}")
            sh.init_data(init_device, init_fn=torch.zeros if sh.allow_shape_mismatch else torch.empty)
        else:
            sh.data = sh.data.detach()
            if sh.allow_shape_mismatch and is_loading:
                sh.data.zero_()
    if shards[0].prepend_axis_num or shards[0].flattened_range is not None:
        torch_sh_ten = sharded_tensor_to_torch_sharded_tensor(shards, load_legacy_1d_flatten_tensors=legacy_1d)
        torch_sh_ten.key = shards[0].key
        return torch_sh_ten
    if len(shards) > 1:
        return LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(sh) for sh in shards])
    return CheckpointableShardedTensor.from_sh_ten(shards[0])


class MCoreSavePlanner(DefaultSavePlanner):
    """DCP save planner for :func:`mcore_to_pyt_state_dict`'s output: object bytes are written on every rank
    (each rank's ``ShardedObject`` shards are its own) and passed through unchanged.

    ``can_run_decentralized_global_plan`` (default) lets each rank turn its local plan into its global
    plan alone; it needs ``dedup_replicated_tensors`` off and ``flatten_state_dict=False``.
    """

    def __init__(self, *args: Any, dedup_replicated_tensors: bool | None = None,
                 can_run_decentralized_global_plan: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan
        if can_run_decentralized_global_plan and (dedup_replicated_tensors or self.flatten_state_dict):
            raise ValueError("can_run_decentralized_global_plan=True needs dedup_replicated_tensors and "
                             f"flatten_state_dict off (got {dedup_replicated_tensors}, {self.flatten_state_dict})")

    def create_local_plan(self) -> SavePlan:
        """A write item per tensor chunk and per object blob, on every rank."""
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            items += _create_write_items(fqn, obj)
        self.plan = SavePlan(items=items, planner_data=self.mappings)
        return self.plan

    def create_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The local plan is already global (no deduplication, no flattening)."""
        if self.flatten_state_dict or local_plan.planner_data:
            raise CheckpointingException("a decentralized global plan needs flatten_state_dict=False and no "
                                         "planner data")
        return local_plan

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        """Object blobs are already serialized."""
        return object


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that first checks every ``shapes_validation_sharded_tensors`` entry's global shape
    against the checkpoint, and lets ``allow_shape_mismatch_sharded_tensors`` (key -> ShardedTensor) read a
    differently shaped saved tensor (DCP's own size check sees the expected shape while planning).
    """

    def __init__(self, *args: Any, shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
                 allow_shape_mismatch_sharded_tensors: dict[str, ShardedTensor] | None = None,
                 stream_ckpt_dequant: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors
        self.stream_ckpt_dequant = stream_ckpt_dequant

    def _validate_global_shapes(self, metadata: Metadata, sharded_tensors: Iterable[ShardedTensor]) -> None:
        for sh in sharded_tensors:
            if sh.key not in metadata.state_dict_metadata:
                raise KeyError(f"{sh.key} from model not in state dict: {sorted(metadata.state_dict_metadata)}")
            loaded = tuple(metadata.state_dict_metadata[sh.key].size)
            if loaded != tuple(sh.global_shape):
                raise CheckpointingException(f"Global shape mismatch for loaded ({loaded}) and expected "
                                             f"({tuple(sh.global_shape)}) tensor for key {sh.key}")

    @contextmanager
    def _temporarily_bypass_shape_validation(self) -> Iterator[None]:
        entries = [(self.metadata.state_dict_metadata[k], self.metadata.state_dict_metadata[k].size, sh)
                   for k, sh in (self.allow_shape_mismatch_sharded_tensors or {}).items()]
        try:
            for md, _, sh in entries:
                md.size = torch.Size(sh.global_shape)
            yield
        finally:
            for md, size, _ in entries:
                md.size = size

    def create_local_plan(self) -> LoadPlan:
        """Validate global shapes, then DCP's plan."""
        self._validate_global_shapes(self.metadata, self.shapes_validation_sharded_tensors)
        with self._temporarily_bypass_shape_validation():
            return super().create_local_plan()
