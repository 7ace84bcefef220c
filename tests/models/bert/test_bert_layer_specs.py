"""The BERT layer specs: padding-masked self-attention, the local spec's parts and keys map, and the
Transformer Engine spec (importable without Transformer Engine; building it then names the ``te`` extra)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from megatron_core.extensions.transformer_engine import (
    TEDotProductAttention,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
)
from megatron_core.models.bert import bert_layer_specs
from megatron_core.models.bert.bert_layer_specs import (
    bert_layer_local_spec,
    get_bert_layer_with_transformer_engine_spec,
)
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.transformer_layer import TransformerLayer
from tests.models.bert.bert_test_utils import build


def test_local_spec_parts():
    layer = bert_layer_local_spec.submodules
    attention = layer.self_attention
    assert bert_layer_local_spec.module is TransformerLayer
    assert attention.params == {"attn_mask_type": AttnMaskType.padding}
    assert (attention.submodules.linear_qkv, attention.submodules.core_attention, attention.submodules.linear_proj) == (
        ColumnParallelLinear, DotProductAttention, RowParallelLinear)
    assert attention.submodules.q_layernorm is IdentityOp and attention.submodules.k_layernorm is IdentityOp
    assert (layer.mlp.submodules.linear_fc1, layer.mlp.submodules.linear_fc2) == (ColumnParallelLinear,
                                                                                  RowParallelLinear)
    assert layer.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                                 "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def test_transformer_engine_spec_imports_and_warns_through_the_old_name():
    with pytest.warns(DeprecationWarning, match="get_bert_layer_with_transformer_engine_spec"):
        from megatron_core.models.bert.bert_layer_specs import bert_layer_with_transformer_engine_spec
    for spec in (bert_layer_with_transformer_engine_spec, get_bert_layer_with_transformer_engine_spec()):
        layer = spec.submodules
        attention = layer.self_attention
        assert spec.module is TransformerLayer and attention.params == {"attn_mask_type": AttnMaskType.padding}
        assert (attention.submodules.linear_qkv, attention.submodules.core_attention,
                attention.submodules.linear_proj) == (TELayerNormColumnParallelLinear, TEDotProductAttention,
                                                      TERowParallelLinear)
        assert layer.input_layernorm is IdentityOp and layer.pre_mlp_layernorm is IdentityOp  # fused into fc1/qkv
        assert layer.mlp.submodules.linear_fc1 is TELayerNormColumnParallelLinear
    with pytest.raises(AttributeError, match="no attribute 'bert_layer_spec'"):
        bert_layer_specs.bert_layer_spec  # noqa: B018


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_transformer_engine_spec_without_transformer_engine_names_the_extra():
    with warnings.catch_warnings(), pytest.raises(ImportError, match=r"\[te\]"):
        warnings.simplefilter("ignore")
        build(transformer_layer_spec=get_bert_layer_with_transformer_engine_spec())
