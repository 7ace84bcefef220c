"""Layer specs for BERT (Megatron-Core's ``models.bert.bert_layer_specs``).

A BERT layer is a pre-norm ``TransformerLayer`` whose self-attention uses a padding mask (no causal
mask). As in Megatron-Core, the local spec is a module-level object, ``bert_layer_local_spec``
(PyTorch norms and this library's tensor-parallel layers). The Transformer Engine spec comes from
:func:`get_bert_layer_with_transformer_engine_spec`, and the old module attribute
``bert_layer_with_transformer_engine_spec`` still resolves to it, with a deprecation warning.
The Transformer Engine classes come from :mod:`megatron_core.extensions.transformer_engine`, which
imports without Transformer Engine: the spec can always be built and imported, and building a model
from it without Transformer Engine raises the ``ImportError`` naming the ``te`` extra.
"""

from __future__ import annotations

import warnings

from megatron_core.extensions.transformer_engine import (
    TEDotProductAttention,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
)
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_core.transformer.backends import fused_norm_keys_map
from megatron_core.transformer.bias_dropout_add import get_bias_dropout_add
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "bert_layer_local_spec",
    "get_bert_layer_with_transformer_engine_spec",
    "get_bert_layer_with_transformer_engine_submodules",
]

LNImpl = WrappedTorchNorm


def get_bert_layer_with_transformer_engine_submodules() -> TransformerLayerSubmodules:
    """The submodules of a BERT layer on Transformer Engine modules (each pre-norm fused into the next linear)."""
    return TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.padding},
            submodules=SelfAttentionSubmodules(
                linear_qkv=TELayerNormColumnParallelLinear,
                core_attention=TEDotProductAttention,
                linear_proj=TERowParallelLinear,
                q_layernorm=None,
                k_layernorm=None,
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
        mlp=ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear),
        ),
        mlp_bda=get_bias_dropout_add,
    )


def get_bert_layer_with_transformer_engine_spec() -> ModuleSpec:
    """A BERT ``TransformerLayer`` on Transformer Engine modules (needed for fp8 training)."""
    return ModuleSpec(module=TransformerLayer, submodules=get_bert_layer_with_transformer_engine_submodules())


def __getattr__(name: str) -> ModuleSpec:
    """``bert_layer_with_transformer_engine_spec``: the deprecated module attribute, built on access."""
    if name == "bert_layer_with_transformer_engine_spec":
        warnings.warn(
            "bert_layer_specs.bert_layer_with_transformer_engine_spec is deprecated; call "
            "bert_layer_specs.get_bert_layer_with_transformer_engine_spec() instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return get_bert_layer_with_transformer_engine_spec()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


bert_layer_local_spec = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        input_layernorm=LNImpl,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.padding},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=IdentityOp,
                k_layernorm=IdentityOp,
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=LNImpl,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=fused_norm_keys_map(),
    ),
)
"""Pure PyTorch + this library's tensor-parallel layers (Megatron-Core's ``bert_layer_local_spec``)."""
