"""MegatronModule.set_is_first_microbatch only under quantization; get_submodules' errors (Megatron-Core 0.19)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.module import Float16Module, MegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec, get_submodules


class _Child(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.is_first_microbatch = False


class _Quantizable(MegatronModule):
    def __init__(self, config):
        super().__init__(config)
        self.child = _Child()


def _config(**fields):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("fields, expected", [
    ({}, False), ({"quant_recipe": object()}, True), ({"fp8": "hybrid"}, True), ({"use_kitchen": True}, True),
])
def test_flag_is_set_only_under_a_quantization_mode(fields, expected):
    module = _Quantizable(_config(**fields))
    module.set_is_first_microbatch()
    assert module.child.is_first_microbatch is expected


def test_float16_module_forwards_the_rule():
    config = _config(bf16=True)
    wrapped = Float16Module(config, _Quantizable(config))
    wrapped.set_is_first_microbatch()
    assert wrapped.module.child.is_first_microbatch is False


def test_get_submodules_errors():
    with pytest.raises(ValueError, match="Could not find `submodules`"):
        get_submodules(torch.nn.Linear)
    with pytest.raises(KeyError):
        get_submodules(partial(torch.nn.Linear, in_features=1))
    assert get_submodules(partial(torch.nn.Linear, submodules="s")) == "s"
    assert get_submodules(ModuleSpec(module=torch.nn.Linear)) is None
