"""ViT layer specs: the local spec's parts (unmasked attention, separate norms), the ``backend`` swap, and the
Transformer Engine spec's error without Transformer Engine."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_core.models import LocalSpecProvider
from megatron_core.models.vision import (
    get_vit_layer_with_local_spec,
    get_vit_layer_with_transformer_engine_spec,
)
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.attention import SelfAttention
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.mlp import MLP
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_layer import TransformerLayer


def test_local_spec_parts():
    spec = get_vit_layer_with_local_spec()
    parts = spec.submodules
    assert spec.module is TransformerLayer
    assert parts.input_layernorm is WrappedTorchNorm and parts.pre_mlp_layernorm is WrappedTorchNorm
    attention = parts.self_attention
    assert attention.module is SelfAttention and attention.params == {"attn_mask_type": AttnMaskType.no_mask}
    assert attention.submodules.linear_qkv is ColumnParallelLinear
    assert attention.submodules.core_attention is DotProductAttention
    assert attention.submodules.linear_proj is RowParallelLinear
    assert attention.submodules.q_layernorm is None and attention.submodules.k_layernorm is None
    assert parts.mlp.module is MLP
    assert parts.mlp.submodules.linear_fc1 is ColumnParallelLinear
    assert parts.mlp.submodules.linear_fc2 is RowParallelLinear


def test_backend_swaps_one_part():
    class OtherAttention(DotProductAttention):
        pass

    class Provider(LocalSpecProvider):
        def core_attention(self) -> type:
            return OtherAttention

    spec = get_vit_layer_with_local_spec(backend=Provider())
    assert spec.submodules.self_attention.submodules.core_attention is OtherAttention
    assert spec.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_transformer_engine_spec_names_the_extra():
    with pytest.raises(ImportError, match=r"megatron_core\[te\]"):
        get_vit_layer_with_transformer_engine_spec()
