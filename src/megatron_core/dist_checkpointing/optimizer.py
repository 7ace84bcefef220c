"""Optimizer state in model space (Megatron-Core ``dist_checkpointing.optimizer``).

Optimizer states are stored under the key of the model parameter they belong to, prefixed by
the state name (``optimizer.state.exp_avg.<param key>``) and sharded exactly like that
parameter, so they reshard across TP/PP/DP together with the model. A distributed optimizer
holds each state as flat slices of the parameter spread over data-parallel ranks; it turns them
into whole (TP-local) parameter-shaped tensors with :func:`dp_flat_shard_to_full` before saving
and takes its slice back with :func:`full_to_dp_flat_shard` after loading.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import replace
from typing import Any

import torch

from megatron_core._model_utils import to_local_if_dtensor
from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.dict_utils import nested_values
from megatron_core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

logger = logging.getLogger(__name__)

KEEP_VARS_HINT = (
    " The model state dict must hold the model's torch.nn.Parameter objects themselves (call `.state_dict()` with"
    " `keep_vars=True`); to transform a parameter, use a ShardedTensorFactory."
)
"""Appended to errors raised when optimizer tensors cannot be matched to model parameters."""


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.Tensor]) -> dict[int, int]:
    """``{id(param): index}`` over the optimizer's parameters in order (a DTensor counts as its local shard;
    a parameter listed twice keeps its first index)."""
    index_of: dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        index_of.setdefault(id(to_local_if_dtensor(param)), i)
    return index_of


def get_param_id_to_sharded_param_map(model_sharded_state_dict: ShardedStateDict,
                                      optim_params_iter: Iterable[torch.Tensor]) -> dict[int, Any]:
    """``{optimizer param index: model ShardedTensor}``, matching tensors by identity."""
    index_of = get_optim_param_to_id_map(optim_params_iter)
    out: dict[int, Any] = {}
    for sh in nested_values(model_sharded_state_dict):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            continue
        if id(sh.data) in index_of:
            out[index_of[id(sh.data)]] = sh
        else:
            logger.debug("%s is not tracked by the optimizer", sh.key)
    if not out and collectives.get_rank() == 0:
        logger.warning("no model tensor matches an optimizer parameter." + KEEP_VARS_HINT)
    return out


def make_sharded_optimizer_tensor(model_param: ShardedTensor | ShardedTensorFactory, optim_param: torch.Tensor,
                                  prefix: str) -> ShardedTensor | ShardedTensorFactory:
    """``optim_param`` sharded like ``model_param``, under key ``<prefix>.<model key>``."""
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    if tuple(optim_param.shape) != tuple(model_param.local_shape):
        raise ValueError(
            f"optimizer tensor for {model_param.key!r} has shape {tuple(optim_param.shape)}, "
            f"the parameter shard has {model_param.local_shape}." + KEEP_VARS_HINT
        )
    return replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def optim_state_to_sharding_state(optim_state_dict: dict[str, Any], id_to_sharded_param_map: dict[int, Any],
                                  exclude_keys: tuple[str, ...] | str = ()) -> None:
    """Replace a ``torch.optim`` state dict's per-param states by sharded tensors (in place).

    ``param_groups[*]['params']`` become ``LocalNonpersistentObject``s: they are local indices,
    meaningless under another layout, and come back from the optimizer being loaded into.
    """
    excluded = (exclude_keys,) if isinstance(exclude_keys, str) else tuple(exclude_keys)
    sharded: dict[int, dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if param_id not in id_to_sharded_param_map:
            raise ValueError(f"optimizer param {param_id} matches no parameter of the model sharded state dict")
        sharded[param_id] = {
            name: make_sharded_optimizer_tensor(id_to_sharded_param_map[param_id], value, f"optimizer.state.{name}")
            for name, value in param_state.items()
            if name not in excluded
        }
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded


def dp_flat_shard_to_full(flat_shard: torch.Tensor, param_range: tuple[int, int], param_shape: torch.Size,
                          dp_group: Any = None) -> torch.Tensor:
    """The whole parameter-shaped tensor from every DP rank's flat slice (an all-reduce over ``dp_group``).

    Slices of different ranks are disjoint and together cover the parameter.
    """
    start, end = param_range
    full = torch.zeros(torch.Size(param_shape).numel(), dtype=flat_shard.dtype, device=flat_shard.device)
    full[start:end] = flat_shard.reshape(-1)
    return collectives.all_reduce_sum(full, dp_group).view(param_shape)


def full_to_dp_flat_shard(full: torch.Tensor, param_range: tuple[int, int]) -> torch.Tensor:
    """This rank's flat slice ``[start, end)`` of a whole parameter-shaped tensor."""
    start, end = param_range
    return full.reshape(-1)[start:end]
