"""``models.backends``: ``get_backend`` per ``transformer_impl`` and ``InferenceSpecProvider`` (the local layers,
grouped experts, a replicated ``linear``), checked against the local spec on identical weights."""

from __future__ import annotations

import pytest
import torch

from megatron_core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron_core.models.backends import InferenceSpecProvider, LocalSpecProvider, get_backend
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_inference_spec,
)
from megatron_core.tensor_parallel.duplicated_linear import DuplicatedLinear
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe import grouped_linear
from megatron_core.transformer.moe.experts import InferenceGroupedMLP, TEGroupedMLP


def test_get_backend_per_transformer_impl():
    assert type(get_backend("local")) is LocalSpecProvider
    assert type(get_backend("transformer_engine")) is TESpecProvider
    assert type(get_backend("inference_optimized")) is InferenceSpecProvider
    with pytest.raises(ValueError, match="unknown transformer_impl='flash'"):
        get_backend("flash")


def test_inference_provider_slots():
    provider = InferenceSpecProvider()
    assert provider.fuse_layernorm_and_linear() is False and provider.column_parallel_layer_norm_linear() is None
    for grouped_gemm in (False, True):  # always grouped, as Megatron-Core's provider
        experts = provider.grouped_mlp_modules(grouped_gemm)
        assert experts.module is InferenceGroupedMLP and issubclass(InferenceGroupedMLP, TEGroupedMLP)
        assert experts.submodules.linear_fc1 is grouped_linear.ColumnParallelGroupedLinear
        assert experts.submodules.linear_fc2 is grouped_linear.RowParallelGroupedLinear
    assert provider.linear() is DuplicatedLinear


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                             use_cpu_initialization=True, add_bias_linear=False, normalization="RMSNorm")


def test_inference_provider_spec_computes_as_the_inference_layer_spec():
    torch.manual_seed(0)
    reference = GPTModel(_config(), get_gpt_layer_with_inference_spec(), 64, 16).eval()
    model = GPTModel(_config(), get_gpt_layer_local_spec(backend=get_backend("inference_optimized")), 64, 16).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = torch.randint(0, 64, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, None), reference(ids, pos, None), rtol=0, atol=0)
    keys = {getattr(v, "key", k) for k, v in model.sharded_state_dict().items()}
    assert keys == {getattr(v, "key", k) for k, v in reference.sharded_state_dict().items()}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys  # the fused modules' names
