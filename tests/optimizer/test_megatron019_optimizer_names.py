"""optimizer names of Megatron-Core 0.19: check_config_overrides_consistency, copy_optimizer_param_metadata."""

from __future__ import annotations

import pytest
import torch

from megatron_core.optimizer import (
    OptimizerConfig,
    ParamKey,
    _get_param_groups,
    check_config_overrides_consistency,
    get_standard_config_overrides,
)
from megatron_core.optimizer.optimizer import copy_optimizer_param_metadata
from megatron_core.optimizer_param_scheduler import ParamGroupOverride


def test_check_config_overrides_consistency():
    config = OptimizerConfig(optimizer="adam", lr=0.01)
    assert check_config_overrides_consistency(config, None) is True
    assert check_config_overrides_consistency(config, get_standard_config_overrides(config)) is True
    with pytest.raises(ValueError, match="optimizer"):
        check_config_overrides_consistency(config, {ParamKey(name="*.bias"): ParamGroupOverride(optimizer="sgd")})


def test_param_groups_from_overrides_split_no_weight_decay_params():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    config = OptimizerConfig(optimizer="adam", lr=0.01)
    groups = _get_param_groups([net], config, get_standard_config_overrides(config))
    assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0]
    decayed = next(g for g in groups if g["wd_mult"] == 1.0)
    assert [p.shape for p in decayed["params"]] == [torch.Size([4, 4])]
    assert len(_get_param_groups([net], config, None)) == 1
    assert set(decayed) == {"params", "is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr",
                            "max_lr", "min_lr"}
    assert decayed["min_lr"] is None and decayed["max_lr"] == 0.01  # Megatron-Core's entries, min_lr unset


def test_chained_optimizer_may_be_empty_or_hold_torch_optimizers():
    from megatron_core.optimizer import ChainedOptimizer

    assert ChainedOptimizer([]).get_parameters() == []
    net = torch.nn.Linear(2, 2)
    chained = ChainedOptimizer([torch.optim.SGD(net.parameters(), lr=0.1)])
    chained.param_groups[0]["lr"] = 0.2
    assert chained.chained_optimizers[0].param_groups[0]["lr"] == 0.2 and chained.config is None


def test_copy_optimizer_param_metadata():
    source, destination = torch.empty(1), torch.empty(1)
    source.allreduce, source.shared, source.grad_norm_group = False, True, "mtp"
    copy_optimizer_param_metadata(destination, source)
    assert (destination.allreduce, destination.shared, destination.grad_norm_group) == (False, True, "mtp")
    bare = torch.empty(1)
    copy_optimizer_param_metadata(bare, torch.empty(1))
    assert not hasattr(bare, "allreduce")
