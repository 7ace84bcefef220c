"""``optimizer.optimizer.param_group_identifier_keys`` (Megatron-Core 0.19) against the groups this library builds."""

from __future__ import annotations

import torch

from megatron_core.optimizer.optimizer import param_group_identifier_keys
from megatron_core.optimizer.param_groups import get_param_groups
from megatron_core.optimizer_param_scheduler import ParamGroupOverride


def test_keys_as_megatron_core():
    assert param_group_identifier_keys == (
        "end_wd", "max_lr", "min_lr", "optimizer", "start_wd", "wd_mult",
        "lr_mult", "is_expert_parallel", "is_decoupled_lr",
    )


def test_every_override_field_is_a_key():
    assert set(ParamGroupOverride.__annotations__) <= set(param_group_identifier_keys)


def test_the_groups_built_here_are_told_apart_by_the_keys():
    from megatron_core.optimizer import OptimizerConfig

    model = torch.nn.Module()
    model.dense = torch.nn.Linear(4, 4)  # weight (decayed) and bias (not decayed)
    model.expert = torch.nn.Parameter(torch.zeros(4))
    model.expert.allreduce = False
    model.embedding = torch.nn.Parameter(torch.zeros(4, 2))
    model.embedding.is_embedding_or_output_parameter = True
    config = OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-4, weight_decay=0.1)
    groups = get_param_groups([model], config)
    identifiers = [tuple(g.get(k) for k in param_group_identifier_keys) for g in groups]
    assert len(groups) >= 3 and len(set(identifiers)) == len(groups)
    for group in groups:
        assert {"lr_mult", "is_expert_parallel", "is_decoupled_lr", "max_lr", "min_lr", "wd_mult"} <= set(group)
