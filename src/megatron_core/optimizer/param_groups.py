"""Param groups for Megatron-style optimizers: per-parameter learning-rate and weight-decay settings.

Two ways to say which parameters get what, both giving groups with ``wd_mult``, ``lr_mult``, ``max_lr``,
``min_lr``, ``is_expert_parallel``, ``is_decoupled_lr``, ``default_config`` (the group follows the default
learning-rate schedule) and the initial ``lr`` / ``weight_decay``:

- :func:`get_param_groups_from_overrides` (Megatron-Core 0.19's ``config_overrides``): a dict of
  :class:`~megatron_core.optimizer.param_keys.ParamKey` -> ``ParamGroupOverride``; the overrides of every key that
  matches a parameter are combined, and parameters with equal combined overrides share a group.
- :func:`get_param_groups` (the earlier conditions): biases and every 1-D parameter (norm weights) get no weight
  decay; ``scale_lr_cond`` marks params whose learning rate is multiplied by ``lr_mult``; embedding and output
  weights (``is_embedding_or_output_parameter``) use ``decoupled_lr`` when it is set.

Expert params (``param.allreduce == False``) are kept in separate groups so they get their own optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.optimizer.param_keys import ParamKey
from megatron_core.optimizer_param_scheduler import (
    ParamGroupOverride,
    combine_param_group_overrides,
    param_group_override_to_tuple,
)

ParamCondition = Callable[[str, torch.nn.Parameter], bool]


def _trainable_named_parameters(model_chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Each trainable parameter of the chunks once, with its name in the first chunk that holds it."""
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                yield name, param


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """No weight decay for biases and 1-D params (layernorm / RMSNorm weights)."""
    return name.endswith(".bias") or name == "bias" or len(param.shape) == 1


def get_param_groups(model_chunks: list[torch.nn.Module], config: OptimizerConfig,
                     no_weight_decay_cond: ParamCondition | None = None,
                     scale_lr_cond: ParamCondition | None = None, lr_mult: float = 1.0,
                     default_skip_embedding_weight_decay: bool = False) -> list[dict[str, Any]]:
    """Group trainable params by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).

    Each group carries ``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ``is_expert_parallel``,
    ``is_decoupled_lr`` plus initial ``lr`` and ``weight_decay`` for the torch optimizer.
    """
    no_wd = no_weight_decay_cond or default_no_weight_decay
    groups: dict[tuple[float, float, bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in _trainable_named_parameters(model_chunks):
        skip_wd = no_wd(name, param) or (
            default_skip_embedding_weight_decay and "embedding" in name
        )
        scale = scale_lr_cond is not None and scale_lr_cond(name, param)
        is_expert = not getattr(param, "allreduce", True)
        decoupled = config.decoupled_lr is not None and bool(
            getattr(param, "is_embedding_or_output_parameter", False)
        )
        key = (0.0 if skip_wd else 1.0, lr_mult if scale else 1.0, is_expert, decoupled)
        groups.setdefault(key, []).append(param)

    param_groups = []
    for (wd_mult, group_lr_mult, is_expert, decoupled), params in groups.items():
        max_lr = config.decoupled_lr if decoupled else config.lr
        min_lr = config.decoupled_min_lr if decoupled else config.min_lr
        param_groups.append({
            "params": params,
            "wd_mult": wd_mult,
            "lr_mult": group_lr_mult,
            "is_expert_parallel": is_expert,
            "is_decoupled_lr": decoupled,
            "default_config": not decoupled and group_lr_mult == 1.0,
            "max_lr": max_lr,
            "min_lr": min_lr if min_lr is not None else 0.0,
            "lr": max_lr * group_lr_mult,
            "weight_decay": config.weight_decay * wd_mult,
        })
    return param_groups


def get_param_groups_from_overrides(model_chunks: list[torch.nn.Module], config: OptimizerConfig,
                                    config_overrides: dict[ParamKey, ParamGroupOverride]) -> list[dict[str, Any]]:
    """Param groups from ``config_overrides`` (see the module docstring); groups without overrides come first.

    A group starts from ``wd_mult = lr_mult = 1``, ``max_lr = config.lr``, ``min_lr = config.min_lr`` and takes its
    override's values over those; it follows the default schedule (``default_config``) unless the override sets a
    learning-rate field. ``is_decoupled_lr`` marks groups whose ``max_lr`` is ``config.decoupled_lr``.
    """
    members: dict[tuple[tuple | None, bool], list[torch.nn.Parameter]] = {}
    for name, param in _trainable_named_parameters(model_chunks):
        matched = [override for key, override in config_overrides.items() if key.matches(param, name)]
        override = combine_param_group_overrides(matched) if matched else None
        if override is not None and "params" in override:
            raise ValueError("a ParamGroupOverride may not set 'params' (the parameters come from its ParamKey)")
        key = (param_group_override_to_tuple(override), not getattr(param, "allreduce", True))
        members.setdefault(key, []).append(param)
    param_groups = []
    for (items, is_expert), params in sorted(members.items(), key=lambda kv: (kv[0][0] is not None, kv[0])):
        override = dict(items or ())
        group: dict[str, Any] = {
            "params": params, "is_expert_parallel": is_expert, "wd_mult": 1.0, "lr_mult": 1.0,
            "max_lr": config.lr, "min_lr": config.min_lr if config.min_lr is not None else 0.0,
            "default_config": not any("lr" in k for k in override), **override,
        }
        group["is_decoupled_lr"] = (config.decoupled_lr is not None and "max_lr" in override
                                    and override["max_lr"] == config.decoupled_lr)
        group["lr"] = group["max_lr"] * group["lr_mult"]
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
        param_groups.append(group)
    return param_groups


def _global_param_names(model_chunks: list[torch.nn.Module]) -> dict[int, str]:
    """``id(param) -> name`` unique over the whole model (Megatron-Core's ``get_global_unique_param_name``: layers
    and routed experts under their global indices)."""
    from megatron_core.transformer.fsdp_dtensor_checkpoint import global_param_names

    return global_param_names(model_chunks)


def dump_param_group_map(model_chunks: list[torch.nn.Module], param_groups: list[dict[str, Any]], path: str) -> None:
    """Save ``{global parameter name: index of its param group}`` at ``path`` with ``torch.distributed.checkpoint``
    (Megatron-Core's ``dump_param_to_param_group_map``); every rank adds its own parameters."""
    import torch.distributed.checkpoint as dcp

    names = _global_param_names(model_chunks)
    mapping = {names[id(param)]: index for index, group in enumerate(param_groups) for param in group["params"]}
    dcp.save(state_dict=mapping, checkpoint_id=path)
