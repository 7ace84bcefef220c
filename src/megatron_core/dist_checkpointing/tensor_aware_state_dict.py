"""A sharded state dict split into tensors and everything else (Megatron-Core ``tensor_aware_state_dict``).

:class:`MCoreTensorAwareStateDict` is what in-memory / node-local checkpointing (the local
checkpoint manager of nvidia-resiliency-ext) saves: the common state plus the sharded entries,
whose tensor data can be popped out (leaving a *hollow*, cheaply picklable skeleton), inserted
back, re-allocated, or copied to CPU and restored. With ``algo="fully_parallel"`` each replicated
tensor shard is kept by one rank of the parallelization group only and sent back by
:meth:`~MCoreTensorAwareStateDict.to_state_dict` (with its ``exchange_algo``, see :mod:`.exchange_utils`).

The base class is nvidia-resiliency-ext's ``TensorAwareStateDict`` when that package is installed
(:data:`HAVE_NVRX`); otherwise a local abstract class with the same methods stands in, and
everything here works without it (unlike Megatron-Core, whose ``from_state_dict`` requires it).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    extract_matching_values,
    lists_like,
    merge,
    nested_values,
    without_matching,
)
from megatron_core.dist_checkpointing.exchange_utils import (
    EXCHANGE_ALGOS,
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
)
from megatron_core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from megatron_core.dist_checkpointing.utils import _sharded_object_id, _sharded_tensor_shard_id
from megatron_core.dist_checkpointing.validation import (
    StrictHandling,
    parse_strict_flag,
    validate_common_state_consistency,
    validate_sharding_integrity,
)

__all__ = ["HAVE_NVRX", "MCoreTensorAwareStateDict", "ShardDistribution", "TensorAwareStateDict"]

logger = logging.getLogger(__name__)
_ALGOS = ("atomic", "fully_parallel")
_ORIG_DEVICE = "orig_device"  # attribute marking a popped (or CPU-copied) tensor's original device type


class _LocalTensorAwareStateDict(ABC):
    """The interface of nvidia-resiliency-ext's ``TensorAwareStateDict`` (used when it is not installed)."""

    @abstractmethod
    def pop_tensors(self) -> list[torch.Tensor]:
        """Remove and return the tensor data, keeping the metadata (the state becomes hollow)."""

    @property
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensor data."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True while the tensors are popped out."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put back what :meth:`pop_tensors` returned."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Allocate empty tensors in place of the popped ones."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies, remembering their devices."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to the devices they came from."""

    def values(self) -> Any:
        """The attribute values of this object."""
        return vars(self).values()


def _resolve_base() -> tuple[type, bool]:
    try:  # optional dependency: nvidia-resiliency-ext's local checkpointing
        from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict as base
    except ImportError:
        return _LocalTensorAwareStateDict, False
    return base, True


TensorAwareStateDict, HAVE_NVRX = _resolve_base()


def _check_algo(algo: str) -> None:
    if algo not in _ALGOS:
        raise NotImplementedError(f"algo={algo!r} is not supported; use one of {list(_ALGOS)}")


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """The common state dict and the sharded entries (``ShardedTensor`` / ``ShardedObject``) of one rank.

    Build it with :meth:`from_state_dict`; turn it back into a loadable state dict with
    :meth:`to_state_dict`. A ``ShardedTensor`` whose ``data`` is None and which carries no
    ``orig_device`` attribute was left to another rank by ``fully_parallel`` deduplication.
    """

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    @classmethod
    def from_state_dict(cls, sharded_state_dict: ShardedStateDict, algo: str = "fully_parallel",
                        parallelization_group: Any = None, cached_metadata: ShardDistribution | None = None,
                        ) -> tuple[MCoreTensorAwareStateDict, ShardDistribution | None]:
        """Wrap ``sharded_state_dict`` (factories applied in place, non-persistent entries dropped).

        ``algo="fully_parallel"`` keeps every tensor shard replicated within ``parallelization_group``
        (default: all ranks) on one rank only (collective); ``"atomic"`` keeps everything.
        ``cached_metadata`` (the distribution returned by an earlier call on a state dict of the same
        structure) skips recomputing it and the sharding validation. Returns ``(wrapper, distribution)``;
        the distribution is None for ``atomic`` or a group of one rank.
        """
        _check_algo(algo)
        apply_factories(sharded_state_dict)
        sharded_part, _ = extract_matching_values(sharded_state_dict, lambda x: isinstance(x, ShardedBase))
        common = without_matching(sharded_state_dict, lambda x: isinstance(x, (ShardedBase, LocalNonpersistentObject)))
        if cached_metadata is None:
            validate_sharding_integrity([x for x in nested_values(sharded_part) if isinstance(x, ShardedBase)])
            validate_common_state_consistency(common)
        distribution = None
        if algo == "fully_parallel":
            distribution = cached_metadata or determine_main_replica_uniform_distribution(
                sharded_part, parallelization_group, True)
        if distribution is not None:
            me = collectives.get_rank(parallelization_group)
            for sh in nested_values(sharded_part):
                if isinstance(sh, ShardedTensor) and distribution.main_rank_for_shard.get(_sharded_tensor_shard_id(sh)) != me:
                    sh.data = None
        return cls(common=common, sharded_state_dict=sharded_part), distribution

    @property
    def is_hollow(self) -> bool:
        """True while the tensors are popped out (between :meth:`pop_tensors` and insert / init)."""
        return self._is_hollow

    def _require(self, hollow: bool, action: str) -> None:
        if self._is_hollow != hollow:
            state = "hollow (tensors popped)" if self._is_hollow else "not hollow"
            raise CheckpointingException(f"cannot {action}: the tensor-aware state dict is {state}")

    @property
    def _sharded_tensors(self) -> Iterator[ShardedTensor]:
        """Tensors this rank keeps: with data, or (when hollow) marked with their original device."""
        for sh in nested_values(self.sharded_state_dict):
            if isinstance(sh, ShardedTensor) and (hasattr(sh, _ORIG_DEVICE) if self._is_hollow else sh.data is not None):
                yield sh

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """This rank's tensor data, in a fixed order (the order of :meth:`pop_tensors`)."""
        self._require(False, "list tensors")
        return (sh.data for sh in self._sharded_tensors)

    @property
    def common_state_dict(self) -> StateDict:
        """The common (non-sharded) part."""
        return self.common

    def pop_tensors(self) -> list[torch.Tensor]:
        """Remove and return the tensor data; the metadata (and original device) stays."""
        self._require(False, "pop tensors")
        popped = []
        for sh in list(self._sharded_tensors):
            popped.append(sh.data)
            setattr(sh, _ORIG_DEVICE, sh.data.device.type)
            sh.data = None
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back in :meth:`pop_tensors` order (shape and dtype must match the metadata)."""
        self._require(True, "insert tensors")
        slots = list(self._sharded_tensors)
        tensors = list(tensor_data)
        if len(tensors) != len(slots):
            raise CheckpointingException(f"insert_tensors got {len(tensors)} tensors for {len(slots)} slots")
        for sh, tensor in zip(slots, tensors):
            if tuple(tensor.shape) != sh.local_shape or tensor.dtype != sh.dtype:
                raise CheckpointingException(
                    f"insert_tensors: {sh.key!r} expects shape {sh.local_shape} and dtype {sh.dtype}, got "
                    f"{tuple(tensor.shape)} and {tensor.dtype}")
        for sh, tensor in zip(slots, tensors):
            if getattr(sh, _ORIG_DEVICE) == tensor.device.type:
                delattr(sh, _ORIG_DEVICE)  # otherwise kept, so restore_tensor_device moves it back
            sh.data = tensor
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Allocate uninitialised tensors (shape, dtype, original device) in place of the popped ones."""
        self._require(True, "init tensors")
        for sh in list(self._sharded_tensors):
            sh.init_data(getattr(sh, _ORIG_DEVICE))
            delattr(sh, _ORIG_DEVICE)
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace every tensor by a CPU copy (originals untouched); devices are remembered."""
        self._require(False, "copy tensors to CPU")
        for sh in self._sharded_tensors:
            if sh.data.device.type == "cpu":
                if not hasattr(sh, _ORIG_DEVICE):  # not already a copy made here
                    sh.data = sh.data.clone()
            else:
                if not hasattr(sh, _ORIG_DEVICE):
                    setattr(sh, _ORIG_DEVICE, sh.data.device.type)
                sh.data = sh.data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move tensors copied by :meth:`copy_tensors_to_cpu` back to their original devices."""
        self._require(False, "restore tensor devices")
        for sh in self._sharded_tensors:
            if hasattr(sh, _ORIG_DEVICE):
                sh.data = sh.data.to(getattr(sh, _ORIG_DEVICE), non_blocking=non_blocking)
                delattr(sh, _ORIG_DEVICE)

    def _fill(self, sharded_part: ShardedStateDict, fully_parallel: bool, group: Any, exchange_algo: str) -> None:
        """Replace the requested entries of ``sharded_part`` by the stored data (in place)."""
        tensors = {_sharded_tensor_shard_id(sh): sh.data for sh in self._sharded_tensors}
        if fully_parallel:
            distribution = determine_main_replica_uniform_distribution(sharded_part, group, True)
            if distribution is not None:
                needed = {_sharded_tensor_shard_id(sh): sh for sh in nested_values(sharded_part)
                          if isinstance(sh, ShardedTensor) and _sharded_tensor_shard_id(sh) not in tensors}
                tensors = exchange_by_distribution(tensors, needed, distribution, group, exchange_algo)
        objects = {_sharded_object_id(sh): sh.data for sh in nested_values(self.sharded_state_dict)
                   if isinstance(sh, ShardedObject)}

        def fill(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                sid = _sharded_tensor_shard_id(x)
                if sid not in tensors:
                    raise CheckpointingException(f"no stored data for tensor {x.key!r} at offset {x.global_offset}")
                return tensors[sid]
            if isinstance(x, ShardedObject):
                sid = _sharded_object_id(x)
                if sid not in objects:
                    raise CheckpointingException(f"no stored object {x.unique_key!r}")
                return objects[sid]
            return x

        dict_list_map_inplace(fill, sharded_part)

    def to_state_dict(self, sharded_state_dict: ShardedStateDict, algo: str = "atomic",
                      exchange_algo: str = "broadcast", validate_access_integrity: bool = True,
                      parallelization_group: Any = None,
                      strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
                      return_mismatch_keys: bool = False) -> StateDict | tuple[StateDict, set[str], set[str]]:
        """The state dict ``sharded_state_dict`` asks for, filled from this object (``load``'s result shape).

        ``sharded_state_dict`` is not modified. ``algo`` must match the one used to build this
        object (``fully_parallel`` is collective and receives deduplicated shards with ``exchange_algo``,
        see :func:`.exchange_utils.exchange_by_distribution`). ``strict`` treats keys missing here / never requested as ``load``
        does; ``return_mismatch_keys`` also returns ``(missing_keys, unexpected_keys)``.
        """
        self._require(False, "rebuild the state dict")
        _check_algo(algo)
        if exchange_algo not in EXCHANGE_ALGOS:
            raise ValueError(f"exchange_algo={exchange_algo!r} must be one of {list(EXCHANGE_ALGOS)}")
        strict = parse_strict_flag(strict)
        result = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return (result, set(), set()) if return_mismatch_keys else result
        requested = dict_list_map_outplace(lambda x: x, sharded_state_dict)
        factories, _ = extract_matching_values(requested, lambda x: isinstance(x, ShardedTensorFactory),
                                               return_lists_as_dicts=True)
        apply_factories(requested)
        nonpersistent, _ = extract_matching_values(requested, lambda x: isinstance(x, LocalNonpersistentObject),
                                                   return_lists_as_dicts=True)
        sharded_part, _ = extract_matching_values(requested, lambda x: isinstance(x, ShardedBase),
                                                  return_lists_as_dicts=True)
        leaves = [x for x in nested_values(sharded_part) if isinstance(x, ShardedBase)]
        if validate_access_integrity:
            validate_sharding_integrity(leaves)
        stored = {sh.key for sh in nested_values(self.sharded_state_dict) if isinstance(sh, ShardedBase)}
        missing = {sh.key for sh in leaves} - stored
        unexpected: set[str] = set()
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            everyone = set().union(*collectives.all_gather_object({sh.key for sh in leaves}))
            unexpected = stored - everyone
        error = _mismatch_error(strict, missing, unexpected)
        if algo == "fully_parallel" and collectives.any_rank_true(error is not None, parallelization_group):
            error = error or "key mismatch on another rank of the parallelization group"
        if error is not None:
            raise CheckpointingException(error)
        if missing:
            sharded_part, _ = extract_matching_values(
                sharded_part, lambda x: isinstance(x, ShardedBase) and x.key not in missing,
                return_lists_as_dicts=True)
        self._fill(sharded_part, algo == "fully_parallel", parallelization_group, exchange_algo)
        dict_list_map_inplace(lambda x: x.unwrap() if isinstance(x, LocalNonpersistentObject) else x, nonpersistent)
        result = merge(merge(result, lists_like(sharded_part, sharded_state_dict)),
                       lists_like(nonpersistent, sharded_state_dict))
        if factories:
            result = apply_factory_merges(result, factories)
        return (result, missing, unexpected) if return_mismatch_keys else result


def _mismatch_error(strict: StrictHandling, missing: set[str], unexpected: set[str]) -> str | None:
    """Log missing / unexpected keys as ``strict`` says; the error to raise, if ``strict`` forbids them."""
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        logger.warning("stored keys not requested: %s", sorted(unexpected)[:20])
    if strict == StrictHandling.LOG_ALL and missing:
        logger.warning("requested keys missing from the tensor-aware state dict: %s", sorted(missing)[:20])
    if missing and not StrictHandling.tolerates_missing_keys(strict):
        return f"{len(missing)} requested keys are not in the tensor-aware state dict: {sorted(missing)[:10]}"
    if unexpected and strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        return f"{len(unexpected)} stored keys were not requested: {sorted(unexpected)[:10]}"
    return None
