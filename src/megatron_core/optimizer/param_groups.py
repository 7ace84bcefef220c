"""Param groups for Megatron-style optimizers: weight-decay and learning-rate multipliers per parameter.

By default biases and every 1-D parameter (norm weights) get no weight decay; ``scale_lr_cond``
marks params whose learning rate is multiplied by ``lr_mult``; embedding and output weights
(``is_embedding_or_output_parameter``) use ``decoupled_lr`` when it is set. Expert params
(``param.allreduce == False``) are kept in separate groups so they get their own optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.optimizer.optimizer_config import OptimizerConfig

ParamCondition = Callable[[str, torch.nn.Parameter], bool]


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
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
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
            "max_lr": max_lr,
            "min_lr": min_lr if min_lr is not None else 0.0,
            "lr": max_lr * group_lr_mult,
            "weight_decay": config.weight_decay * wd_mult,
        })
    return param_groups
