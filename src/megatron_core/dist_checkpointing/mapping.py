"""What a sharded state dict is made of (Megatron-Core ``dist_checkpointing.mapping``).

A *sharded state dict* is a nested dict/list whose leaves are:

- :class:`ShardedTensor`: this rank's piece of a global tensor, placed by ``global_offset`` inside
  ``global_shape``. Keys are global (the same on every rank and under every parallel layout), so
  a checkpoint written under one (TP, PP, DP) layout loads under any other.
- :class:`ShardedObject`: a picklable object stored atomically per shard (RNG states, extra state).
- :class:`ShardedTensorFactory`: a lazy 1-to-N transform, e.g. a fused ``[gate; up]`` weight that
  must be stored as two TP-independent halves; ``merge_fn`` joins the halves on load.
- :class:`LocalNonpersistentObject`: handed back on load without being saved.
- anything else is *common* state, identical on every rank and written once.

``replica_id`` says which copy of a replicated shard this is; only the main replica (``0`` or a
tuple of zeros) is written. ``prepend_axis_num`` leading global axes do not exist in the local
tensor (e.g. the stacked layer axis added by ``TransformerBlock``): locally they have size 1.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Union

import torch

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.dict_utils import dict_list_map_inplace

logger = logging.getLogger(__name__)

ReplicaId = Union[int, tuple[int, ...]]
StateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
CommonStateDict = dict[str, Any]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the copy that gets written: replica id ``0`` or all zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """Common interface of :class:`ShardedTensor` and :class:`ShardedObject`."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise ``CheckpointingException`` if the shard's metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy carrying only metadata (used when exchanging shard descriptions between ranks)."""


@dataclass
class ShardedTensor(ShardedBase):
    """This rank's shard of the global tensor ``key``.

    ``global_offset`` is in elements along every global axis (for prepended axes it is the index).
    ``axis_fragmentations`` is how many shards each global axis is cut into (informational:
    validation checks exact coverage, not a regular grid).
    """

    key: str
    data: torch.Tensor | None
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(self.local_shape)
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check shape/offset/rank consistency; raises naming the key and the offending values."""
        where = f"ShardedTensor {self.key!r}"
        if self.flattened_range is not None:
            raise CheckpointingException(
                f"{where}: flattened_range is a legacy format that megatron_core does not save or load; "
                "store optimizer state in model space (see docs/dist_checkpointing.md)"
            )
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"{where}: global_shape {self.global_shape} and global_offset {self.global_offset} differ in rank"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"{where}: local_shape {self.local_shape} plus prepend_axis_num {self.prepend_axis_num} "
                f"does not match global_shape {self.global_shape}"
            )
        for axis, (off, size) in enumerate(zip(self.global_offset, self.chunk_sizes())):
            if off < 0 or off + size > self.global_shape[axis]:
                raise CheckpointingException(
                    f"{where}: shard at offset {self.global_offset} with size {self.chunk_sizes()} lies outside "
                    f"global_shape {self.global_shape} (axis {axis})"
                )
        if self.data is not None:
            if tuple(self.data.shape) != self.local_shape:
                raise CheckpointingException(
                    f"{where}: data shape {tuple(self.data.shape)} != local_shape {self.local_shape}"
                )
            if self.data.dtype != self.dtype:
                raise CheckpointingException(f"{where}: data dtype {self.data.dtype} != dtype {self.dtype}")

    def chunk_sizes(self) -> tuple[int, ...]:
        """The shard's extent along every global axis (1 on prepended axes)."""
        return (1,) * self.prepend_axis_num + self.local_shape

    def global_slice(self) -> tuple[slice | int, ...]:
        """Index of this shard inside the global tensor (ints on prepended axes)."""
        prepended = tuple(self.global_offset[: self.prepend_axis_num])
        rest = tuple(
            slice(off, off + size)
            for off, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        )
        return prepended + rest

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Offset of the shard in units of shards (global_offset divided by the local extent)."""
        return tuple(off // size for off, size in zip(self.global_offset, self.chunk_sizes()))

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """How many shards of this size fit along every global axis."""
        return tuple(g // s for g, s in zip(self.global_shape, self.chunk_sizes()))

    def numel(self) -> int:
        """Number of elements in this shard."""
        return math.prod(self.local_shape)

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """``torch.narrow`` on every rank's local tensor, as a list of one ShardedTensor.

        ``dim`` counts local axes (prepended axes excluded). Every rank keeps ``length`` of its
        ``local_shape[dim]`` elements, so the global extent and this shard's offset along that axis
        scale by ``length / local_shape[dim]``; that needs a regular grid of equal local shards
        (``CheckpointingException`` otherwise).
        """
        axis = dim + self.prepend_axis_num
        local = self.local_shape[dim]
        if self.global_shape[axis] % local or self.global_offset[axis] % local:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrowing needs a regular grid of local shards along axis {axis} "
                f"(global_shape {self.global_shape}, global_offset {self.global_offset}, local size {local})"
            )

        def scaled(values: tuple[int, ...]) -> tuple[int, ...]:
            return values[:axis] + (values[axis] // local * length,) + values[axis + 1:]

        data = self.data.narrow(dim, start, length) if self.data is not None else None
        local_shape = self.local_shape[:dim] + (length,) + self.local_shape[dim + 1:]
        return [replace(self, data=data, local_shape=local_shape, global_shape=scaled(self.global_shape),
                        global_offset=scaled(self.global_offset))]

    def without_data(self) -> ShardedTensor:
        """A metadata-only copy."""
        return replace(self, data=None)

    def init_data(self, device: torch.device | str, init_fn: Callable[..., torch.Tensor] = torch.empty) -> None:
        """Allocate ``data`` (``local_shape``, ``dtype``) on ``device`` unless it is already set."""
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: slice | None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """A shard of a tensor cut evenly along some axes.

        Each ``(axis, axis_rank_offset, axis_fragmentations)`` says that global ``axis`` is cut into
        ``axis_fragmentations`` equal pieces and this rank holds piece ``axis_rank_offset``; e.g. a
        column-parallel weight is ``(0, tp_rank, tp_size)``. Axes below ``prepend_axis_num`` are the
        prepended ones (local size 1).
        """
        ndim = data.dim() + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        fragmentations = [1] * ndim
        seen: set[int] = set()
        for axis, rank_offset, fragm in rank_offsets:
            if not 0 <= axis < ndim:
                raise CheckpointingException(f"ShardedTensor {key!r}: axis {axis} out of range for {ndim} dims")
            if axis in seen:
                raise CheckpointingException(f"ShardedTensor {key!r}: axis {axis} given twice in rank_offsets")
            if not 0 <= rank_offset < fragm:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: axis_rank_offset {rank_offset} not in [0, {fragm}) on axis {axis}"
                )
            seen.add(axis)
            fragmentations[axis] = fragm
            global_offset[axis] = rank_offset * global_shape[axis]
            global_shape[axis] *= fragm
        return cls(
            key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(global_offset),
            tuple(fragmentations), replica_id, prepend_axis_num, flattened_range=flattened_range, **init_kwargs,
        )

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


@dataclass
class ShardedObject(ShardedBase):
    """A picklable object stored as one unit per shard.

    ``global_shape``/``global_offset`` place it in a grid of objects (e.g. one RNG state per
    (pp, tp) rank); its storage key is :attr:`unique_key`. Loaded objects must be plain data
    (tensors, numbers, strings, containers), because loading uses ``torch.load(weights_only=True)``.
    """

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check that the offset lies inside the grid."""
        if len(self.global_shape) != len(self.global_offset) or any(
            not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape)
        ):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: offset {self.global_offset} not inside grid {self.global_shape}"
            )

    def without_data(self) -> ShardedObject:
        """A metadata-only copy."""
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """Storage key: ``key/shard_<offsets joined by '.'>_<shape joined by '.'>``."""
        offsets = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The (data-less) ShardedObject that :attr:`unique_key` describes."""
        key, shard = unique_key.rsplit("/", 1)
        _, offsets, shape = shard.split("_")
        return cls(key, None, tuple(map(int, shape.split("."))), tuple(map(int, offsets.split("."))), replica_id)

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Union[slice, None]], ShardedStateDict]
"""``build_fn(key, data, replica_id, flattened_range)`` of a :class:`ShardedTensorFactory`."""
FactoryMergeFn = Callable[[StateDict], torch.Tensor]
"""``merge_fn(loaded_sub_state_dict)`` of a :class:`ShardedTensorFactory`."""


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor stored as several sharded pieces: ``build_fn`` splits it, ``merge_fn`` joins them.

    ``build_fn(key, data, replica_id, flattened_range) -> ShardedStateDict`` runs before save and
    load; ``merge_fn(loaded_sub_state_dict) -> Tensor`` runs after load.
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """Run ``build_fn`` on this factory's data."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Factories are validated through the shards they build."""

    def without_data(self) -> ShardedTensorFactory:
        """Factories cannot be described without data; building them is how they are inspected."""
        raise CheckpointingException(f"ShardedTensorFactory {self.key!r} must be built before it is exchanged")


@dataclass
class LocalNonpersistentObject:
    """An object that is not saved; ``load`` returns it unwrapped in place."""

    obj: object

    def unwrap(self) -> object:
        """The wrapped object."""
        return self.obj


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds (in place)."""

    def build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(build, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: tuple[str | int, ...] = ()) -> Any:
    """Merge the loaded pieces in ``x1`` wherever ``x2`` (the pre-build dict) holds a factory.

    ``x2`` may be the full original sharded state dict or only its factories (as returned by
    ``extract_matching_values``); positions absent from ``x2`` are left as they are.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise CheckpointingException(f"factory at {'.'.join(map(str, key + (k,)))} has no loaded value")
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            message = f"list at {'.'.join(map(str, key))}: {len(x1)} loaded values for {len(x2)} factories"
            logger.error("%s\nloaded: %s\nfactories: %s", message, x1, x2)
            raise CheckpointingException(message)
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    return x1
