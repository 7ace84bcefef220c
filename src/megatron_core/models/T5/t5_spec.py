"""Layer and block specs for the T5 encoder and decoder (Megatron-Core's ``models.T5.t5_spec``).

The encoder layer is self-attention + MLP; the decoder layer adds a cross-attention sublayer
(``pre_cross_attn_layernorm``, ``cross_attention``, ``cross_attn_bda``) between them. The local specs
use this library's tensor-parallel linears, ``DotProductAttention`` and ``WrappedTorchNorm``; the
Transformer Engine specs use the wrappers of :mod:`megatron_core.extensions.transformer_engine` and
raise ``ImportError`` naming the ``te`` extra when Transformer Engine is not installed.
"""

from __future__ import annotations

from megatron_core import tensor_parallel
from megatron_core.extensions._te_loader import import_te
from megatron_core.transformer.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron_core.transformer.backends import fused_norm_keys_map
from megatron_core.transformer.bias_dropout_add import get_bias_dropout_add
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_block import TransformerBlockSubmodules
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "decoder_model_with_local_spec",
    "decoder_model_with_transformer_engine_default_spec",
    "encoder_model_with_local_spec",
    "encoder_model_with_transformer_engine_default_spec",
    "get_t5_decoder_with_local_block_spec",
    "get_t5_decoder_with_transformer_engine_block_spec",
    "get_t5_encoder_with_local_block_spec",
    "get_t5_encoder_with_transformer_engine_block_spec",
]

# The local layers keep their norms separate; checkpoints store them under Transformer Engine's fused names.
_LOCAL_KEYS_MAP = fused_norm_keys_map()


def _te_modules(what: str) -> dict[str, type]:
    """The Transformer Engine wrapper classes, after checking that Transformer Engine is installed."""
    import_te(what)
    from megatron_core.extensions import transformer_engine as te_ext

    return {name: getattr(te_ext, name) for name in (
        "TEColumnParallelLinear", "TEDotProductAttention", "TELayerNormColumnParallelLinear", "TENorm",
        "TERowParallelLinear")}


def _self_attention(mask_type: AttnMaskType, linear_qkv: type, core_attention: type, linear_proj: type
                    ) -> ModuleSpec:
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": mask_type},
        submodules=SelfAttentionSubmodules(linear_qkv=linear_qkv, core_attention=core_attention,
                                           linear_proj=linear_proj, q_layernorm=IdentityOp, k_layernorm=IdentityOp),
    )


def _cross_attention(mask_type: AttnMaskType, linear: type, core_attention: type, linear_proj: type) -> ModuleSpec:
    return ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": mask_type},
        submodules=CrossAttentionSubmodules(linear_q=linear, linear_kv=linear, core_attention=core_attention,
                                            linear_proj=linear_proj),
    )


def _mlp(linear_fc1: type, linear_fc2: type) -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=linear_fc1, linear_fc2=linear_fc2))


def encoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """The T5 encoder layer on Transformer Engine: padding-masked self-attention and MLP, norms fused into the
    following linear layers."""
    te = _te_modules("encoder_model_with_transformer_engine_default_spec")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=_self_attention(AttnMaskType.padding, te["TELayerNormColumnParallelLinear"],
                                           te["TEDotProductAttention"], te["TERowParallelLinear"]),
            self_attn_bda=get_bias_dropout_add,
            mlp=_mlp(te["TELayerNormColumnParallelLinear"], te["TERowParallelLinear"]),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """The T5 decoder layer on Transformer Engine: causal self-attention, padding-masked cross-attention, MLP."""
    te = _te_modules("decoder_model_with_transformer_engine_default_spec")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=_self_attention(AttnMaskType.causal, te["TELayerNormColumnParallelLinear"],
                                           te["TEDotProductAttention"], te["TERowParallelLinear"]),
            self_attn_bda=get_bias_dropout_add,
            pre_cross_attn_layernorm=te["TENorm"],
            cross_attention=_cross_attention(AttnMaskType.padding, te["TEColumnParallelLinear"],
                                             te["TEDotProductAttention"], te["TERowParallelLinear"]),
            cross_attn_bda=get_bias_dropout_add,
            mlp=_mlp(te["TELayerNormColumnParallelLinear"], te["TERowParallelLinear"]),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def encoder_model_with_local_spec() -> ModuleSpec:
    """The T5 encoder layer on local layers: norm, self-attention under an arbitrary mask, norm, MLP."""
    column, row = tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=_self_attention(AttnMaskType.arbitrary, column, DotProductAttention, row),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=_mlp(column, row),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(_LOCAL_KEYS_MAP),
        ),
    )


def decoder_model_with_local_spec() -> ModuleSpec:
    """The T5 decoder layer on local layers: causal self-attention, cross-attention under an arbitrary mask, MLP,
    each after its own norm."""
    column, row = tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=_self_attention(AttnMaskType.causal, column, DotProductAttention, row),
            self_attn_bda=get_bias_dropout_add,
            pre_cross_attn_layernorm=WrappedTorchNorm,
            cross_attention=_cross_attention(AttnMaskType.arbitrary, column, DotProductAttention, row),
            cross_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=_mlp(column, row),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(_LOCAL_KEYS_MAP),
        ),
    )


def _check_num_layers(num_layers: int) -> None:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers ({num_layers!r}) must be a positive integer")


def get_t5_encoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Transformer Engine encoder layers and a final ``TENorm``."""
    _check_num_layers(num_layers)
    norm = _te_modules("get_t5_encoder_with_transformer_engine_block_spec")["TENorm"]
    return TransformerBlockSubmodules([encoder_model_with_transformer_engine_default_spec()] * num_layers,
                                      layer_norm=norm)


def get_t5_decoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Transformer Engine decoder layers and a final ``TENorm``."""
    _check_num_layers(num_layers)
    norm = _te_modules("get_t5_decoder_with_transformer_engine_block_spec")["TENorm"]
    return TransformerBlockSubmodules([decoder_model_with_transformer_engine_default_spec()] * num_layers,
                                      layer_norm=norm)


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` local encoder layers and a final ``WrappedTorchNorm`` (Megatron-Core names ``TENorm`` here,
    which is absent without Transformer Engine; the local norm computes the same and has the same keys)."""
    _check_num_layers(num_layers)
    return TransformerBlockSubmodules([encoder_model_with_local_spec()] * num_layers, layer_norm=WrappedTorchNorm)


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` local decoder layers and a final ``WrappedTorchNorm`` (see the encoder's)."""
    _check_num_layers(num_layers)
    return TransformerBlockSubmodules([decoder_model_with_local_spec()] * num_layers, layer_norm=WrappedTorchNorm)
