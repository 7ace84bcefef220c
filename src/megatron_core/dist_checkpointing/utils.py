"""Filtering sharded state dicts by leaf type and rewriting sharding keys (Megatron-Core ``utils``).

Also the identity of a shard across ranks (``_sharded_tensor_shard_id``/``_sharded_object_id``, private
as in Megatron-Core), and re-exported here, at Megatron-Core's path: the scoped debug timing of :mod:`.debug_logging`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from megatron_core._ground.fp8_values import dequantize_fp8_tensor, is_fp8_param
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.debug_logging import (
    debug_msg,
    debug_time,
    fallback_logger,
    logger_stack,
)
from megatron_core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
    nested_values,
)
from megatron_core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

__all__ = ["add_prefix_for_sharding", "apply_prefix_mapping", "debug_msg", "debug_time", "extract_nonpersistent",
           "extract_sharded_base", "extract_sharded_tensors", "extract_sharded_tensors_and_factories",
           "extract_sharded_tensors_or_nonpersistent", "fallback_logger", "force_all_tensors_to_non_fp8",
           "logger_stack", "replace_prefix_for_sharding", "zip_strict"]


_ShardId = tuple
"""A shard's identity, equal on every rank holding a replica of it: a tensor's ``(key, global_offset,
flattened range as (start, stop) or None)``, an object's ``(key, global_offset, global_shape)``."""


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """Identity of a tensor shard (same on every replica)."""
    rng = sharded_tensor.flattened_range
    return (sharded_tensor.key, tuple(sharded_tensor.global_offset),
            None if rng is None else (rng.start, rng.stop))


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """Identity of an object shard (same on every replica)."""
    return sharded_object.key, tuple(sharded_object.global_offset), tuple(sharded_object.global_shape)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, Any]:
    """(ShardedTensor leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, Any]:
    """(ShardedTensor and ShardedTensorFactory leaves, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, Any]:
    """(ShardedTensor, factory and LocalNonpersistentObject leaves, everything else)."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory)),
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, Any]:
    """(ShardedTensor and ShardedObject leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, Any]:
    """(LocalNonpersistentObject leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded leaf (in place)."""

    def add_prefix(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Change the key prefix ``old_prefix`` to ``new_prefix`` on every sharded leaf (in place).

    ``TransformerBlock`` uses this to turn ``decoder.layers.<local i>.`` into ``decoder.layers.``
    once the layer index has become a prepended global axis.
    """

    def replace_prefix(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            if not x.key.startswith(old_prefix):
                raise CheckpointingException(f"key {x.key!r} does not start with prefix {old_prefix!r}")
            x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Rename sharded keys by the first matching ``old_prefix -> new_prefix`` entry (in place)."""

    def rename(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            for old, new in prefix_map.items():
                if x.key.startswith(old):
                    x.key = f"{new}{x.key[len(old):]}"
                    break
        return x

    dict_list_map_inplace(rename, sharded_state_dict)


def zip_strict(*args: Sized) -> Iterator[tuple]:
    """``zip`` of sized iterables that must have equal lengths: ``ValueError`` naming the lengths otherwise."""
    lengths = [len(a) for a in args]
    if len(set(lengths)) > 1:
        raise ValueError(f"zip_strict: iterables of unequal lengths {lengths}")
    return zip(*args)


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace the data of every leaf holding an FP8 parameter by its high-precision value (in place)."""
    for leaf in nested_values(sharded_state_dict):
        if is_fp8_param(getattr(leaf, "data", None)):
            leaf.data = dequantize_fp8_tensor(leaf.data)
