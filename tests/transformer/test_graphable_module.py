"""``GraphableMegatronModule``: Megatron-Core 0.19's base of the modules CUDA graphs can record.

The four graphable classes derive from it; it refuses a config that is not a ``TransformerConfig``; its static
inputs take their sizes from the process groups; its manual hooks cover each module owning parameters once; only
``TransformerLayer`` routes calls through recorded graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.models.hybrid.hybrid_model import HybridModel
from megatron_core.ssm.mamba_layer import MambaLayer
from megatron_core.transformer import TransformerConfig, module
from megatron_core.transformer.module import GraphableMegatronModule
from megatron_core.transformer.spec_utils import build_module
from megatron_core.transformer.transformer_block import TransformerBlock
from megatron_core.transformer.transformer_layer import TransformerLayer


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True)
    return TransformerConfig(**{**base, **overrides})


def _layer(config: TransformerConfig) -> TransformerLayer:
    return build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)


class _FakeGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("cls", [TransformerLayer, MambaLayer, TransformerBlock, HybridModel])
def test_the_graphable_classes_derive_from_it(cls):
    assert issubclass(cls, GraphableMegatronModule)


def test_a_config_that_is_not_a_transformer_config_is_refused():
    with pytest.raises(TypeError, match="GraphableMegatronModule needs a TransformerConfig, got ModelParallelConfig"):
        GraphableMegatronModule(ModelParallelConfig())


def test_static_inputs_take_their_sizes_from_the_process_groups(monkeypatch):
    layer = _layer(_config())
    hidden = layer.get_layer_static_inputs(seq_length=32, micro_batch_size=3)["hidden_states"]
    assert hidden.shape == (32, 3, 16) and hidden.requires_grad and hidden.dtype == torch.float32
    assert torch.equal(hidden.detach(), torch.ones(32, 3, 16))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # the groups' sizes count
    monkeypatch.setattr(module, "get_current_device", lambda: torch.device("cpu"))  # (asks the backend then)
    layer.config.sequence_parallel = True
    layer.pg_collection = SimpleNamespace(cp=_FakeGroup(2), tp=_FakeGroup(4))
    assert layer.get_layer_static_inputs(32, 3)["hidden_states"].shape == (4, 3, 16)  # 32 / cp 2 / tp 4


def test_manual_hooks_cover_each_module_owning_parameters_once():
    layer = _layer(_config())
    made = []

    def make_hook():
        made.append(object())
        return lambda module: None

    layer.setup_manual_hooks(make_hook)
    owners = [module for module in layer.modules() if next(module.parameters(recurse=False), None) is not None]
    assert [args[0] for _, args in layer.cuda_graph_manual_hooks] == owners
    assert len(made) == len(owners) > 0


def test_only_the_transformer_layer_routes_through_recorded_graphs():
    layer = _layer(_config())
    hidden = torch.randn(4, 2, 16)
    assert not layer._should_call_local_cudagraph(hidden)  # cuda_graph_impl="none"
    assert not GraphableMegatronModule._should_call_local_cudagraph(layer, hidden)
