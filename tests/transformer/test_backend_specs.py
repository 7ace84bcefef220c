"""Spec building blocks from a backend provider: the fused-norm rule decides norms, linears and checkpoint key maps."""

from __future__ import annotations

from megatron_core.extensions import transformer_engine as te_ext
from megatron_core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron_core.models.bert import bert_layer_specs
from megatron_core.models.hybrid import hybrid_layer_specs
from megatron_core.models.T5 import t5_spec
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.backend_specs import (
    cross_attention_spec,
    dense_mlp_spec,
    norm_keys_map,
    norm_linear,
    pre_norm,
    pre_norm_layer_submodules,
    self_attention_spec,
)
from megatron_core.transformer.backends import (
    INPUT_NORM_KEY,
    PRE_MLP_NORM_KEY,
    LocalSpecProvider,
    fused_norm_keys_map,
)
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

WrappedTorchNorm = LocalSpecProvider().layer_norm()


def test_local_backend_keeps_norms_separate_and_maps_their_keys():
    local = LocalSpecProvider()
    assert pre_norm(local) is WrappedTorchNorm and norm_linear(local) is ColumnParallelLinear
    assert norm_keys_map(local) == {**INPUT_NORM_KEY, **PRE_MLP_NORM_KEY}
    custom = {"norm.": "mixer.in_proj.layer_norm_"}
    mapped = norm_keys_map(local, custom)
    assert mapped == custom and mapped is not custom
    subs = pre_norm_layer_submodules(local, self_attention=self_attention_spec(local, AttnMaskType.causal))
    assert subs.input_layernorm is WrappedTorchNorm and subs.pre_mlp_layernorm is IdentityOp
    assert subs.sharded_state_dict_keys_map == fused_norm_keys_map(mlp=False)
    assert pre_norm_layer_submodules(local, mlp=dense_mlp_spec(local), map_norm_keys=False).sharded_state_dict_keys_map == {}


def test_te_backend_fuses_norms_and_needs_no_key_map():
    te = TESpecProvider()
    assert pre_norm(te) is IdentityOp and norm_linear(te) is te_ext.TELayerNormColumnParallelLinear
    assert norm_keys_map(te) == {}
    attention = self_attention_spec(te, AttnMaskType.padding)
    assert attention.submodules.linear_qkv is te_ext.TELayerNormColumnParallelLinear
    assert attention.submodules.core_attention is te_ext.TEDotProductAttention
    cross = cross_attention_spec(te, AttnMaskType.padding)
    assert cross.submodules.linear_q is cross.submodules.linear_kv is te_ext.TEColumnParallelLinear
    subs = pre_norm_layer_submodules(te, attention, dense_mlp_spec(te), cross_attention=cross)
    assert subs.input_layernorm is IdentityOp and subs.pre_cross_attn_layernorm is te_ext.TENorm
    assert subs.mlp.submodules.linear_fc1 is te_ext.TELayerNormColumnParallelLinear
    assert subs.sharded_state_dict_keys_map == {}
    assert te.grouped_mlp_modules(True).module is TEGroupedMLP
    assert te.grouped_mlp_modules(False).module is SequentialMLP
    assert te.grouped_mlp_modules(False).submodules.linear_fc1 is te_ext.TEColumnParallelLinear


def test_model_specs_come_from_the_providers():
    te_bert = bert_layer_specs.get_bert_layer_with_transformer_engine_submodules()
    assert te_bert == pre_norm_layer_submodules(
        TESpecProvider(), self_attention_spec(TESpecProvider(), AttnMaskType.padding), dense_mlp_spec(TESpecProvider()))
    local_bert = bert_layer_specs.bert_layer_local_spec.submodules
    assert local_bert.self_attention.submodules.core_attention is DotProductAttention
    assert local_bert.self_attention.submodules.q_layernorm is IdentityOp
    assert local_bert.sharded_state_dict_keys_map == fused_norm_keys_map()
    decoder = t5_spec.decoder_model_with_local_spec().submodules
    assert decoder.pre_cross_attn_layernorm is WrappedTorchNorm
    assert decoder.cross_attention.submodules.linear_proj is RowParallelLinear
    assert decoder.sharded_state_dict_keys_map == fused_norm_keys_map()
    mamba = hybrid_layer_specs.hybrid_stack_spec.submodules.mamba_layer.submodules
    assert mamba.sharded_state_dict_keys_map == {"norm.": "mixer.in_proj.layer_norm_"}
    assert hybrid_layer_specs.hybrid_stack_spec.submodules.moe_layer.submodules.sharded_state_dict_keys_map == {}
