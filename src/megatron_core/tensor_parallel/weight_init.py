"""Tensor-parallel parameter attributes and weight initialisation.

Parameters carry three attributes that later code (gradient clipping, checkpointing, the
distributed optimizer) reads: ``tensor_model_parallel`` (sharded across TP?), ``partition_dim``
(which dim is sharded) and ``partition_stride``. Two ways to initialise a shard, as in
Megatron-Core: on CPU, build the full "master" weight with the global RNG and keep this rank's
slices (identical for every TP size); or directly on the device inside the model-parallel RNG
stream (fast, but each TP size gives different weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.random import (
    _EXPERT_PARALLEL_RNG_TRACKER_NAME,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    get_cuda_rng_tracker,
)

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    expert_tp_group: dist.ProcessGroup | None = None,
) -> bool:
    """True if ``param`` is TP-sharded or this is TP rank 0 (so replicated params are counted once).

    Expert parameters (``allreduce == False``) are filtered over ``expert_tp_group`` when given. A group passed
    explicitly is asked for its rank (as in Megatron-Core); otherwise the registered one is used.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    is_expert = not getattr(param, "allreduce", True)
    explicit = expert_tp_group if is_expert and expert_tp_group is not None else tp_group
    if explicit is not None:
        return explicit.rank() == 0
    return get_pg_rank(resolve_tp_group(None, is_expert=is_expert)) == 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Set ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride`` (they must be unset)."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(f"tensor already has the tensor-parallel attribute '{attribute}'")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the default (replicated) TP attributes where they are missing."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


# Also copied (Megatron-Core 0.19): an expert-TP mark and a fused QKV weight's split, set by some layers.
_COPIED_MODEL_PARALLEL_ATTRIBUTES = (*_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS, "expert_tp", "is_qkv", "qkv_split_shapes")


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    """Copy whichever TP attributes ``source_tensor`` has (also ``expert_tp``, ``is_qkv``, ``qkv_split_shapes``)
    onto ``destination_tensor``."""
    for attribute in _COPIED_MODEL_PARALLEL_ATTRIBUTES:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def _initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method: Callable[[torch.Tensor], object],
    partition_dim: int,
    stride: int = 1,
    is_expert: bool = False,
) -> None:
    """Initialise this rank's shard in place on its device, inside the (expert-)model-parallel RNG stream."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    name = _EXPERT_PARALLEL_RNG_TRACKER_NAME if is_expert else _MODEL_PARALLEL_RNG_TRACKER_NAME
    with get_cuda_rng_tracker().fork(name):
        init_method(weight)


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable[[torch.Tensor], object],
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor | None:
    """Fill ``weight`` with this rank's slices of a full ``[output_size, input_size]`` master weight.

    The master weight is drawn in fp32 with the global CPU RNG, so every TP size sees the same
    numbers. It is cut into pieces of ``per_partition_size / stride`` along ``partition_dim`` and
    rank ``r`` takes pieces ``r, r + world_size, ...`` (interleaved, for fused weights).
    """
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if per_partition_size % stride != 0:
        raise ValueError(f"partition size ({per_partition_size}) is not divisible by stride ({stride})")
    master_weight = torch.empty(output_size, input_size, dtype=torch.float32, requires_grad=False)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)
    pieces = torch.split(master_weight, per_partition_size // stride, dim=partition_dim)
    with torch.no_grad():
        weight.copy_(torch.cat(pieces[rank::world_size], dim=partition_dim))
    return master_weight if return_master_weight else None
