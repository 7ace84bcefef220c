"""Layer specs of heterogeneous GPT models (Megatron-Core's ``get_gpt_heterogeneous_layer_spec``).

One ``TransformerLayer`` spec per block of a ``HeterogeneousTransformerConfig``: a ``no_op`` attention
or MLP becomes an identity (with no norm and no bias-dropout-add in front of it), ``replace_with_linear``
a norm followed by :class:`ColumnParallelLinearGathered`, anything else the local GPT attention / MLP,
which take the block's query groups and FFN width from the per-layer config ``TransformerBlock`` builds
each layer with. As in Megatron-Core's local spec, the separate norms are stored in checkpoints under
Transformer Engine's fused names, but only for blocks whose JSON sets the query groups / FFN width.
"""

from __future__ import annotations

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.backends import LocalSpecProvider
from megatron_core.models.gpt.gpt_layer_specs import _te_spec_provider
from megatron_core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_core.transformer.backends import INPUT_NORM_KEY, PRE_MLP_NORM_KEY
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.heterogeneous.heterogeneous_config import (
    AttentionConfig,
    HeterogeneousTransformerConfig,
    MLPConfig,
    TransformerBlockConfig,
)
from megatron_core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered
from megatron_core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.pipeline_layout import get_num_layers_to_build, get_transformer_layer_offset
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_block import TransformerBlockSubmodules
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["get_gpt_heterogeneous_layer_spec"]

_LOCAL = LocalSpecProvider()


def _norm(part: AttentionConfig | MLPConfig) -> type:
    return IdentityOp if part.no_op else _LOCAL.layer_norm()


def _attention_spec(attention: AttentionConfig, qk_layernorm: bool) -> ModuleSpec:
    if attention.no_op:
        return ModuleSpec(module=IdentityOp)
    if attention.replace_with_linear:
        return ModuleSpec(module=ColumnParallelLinearGathered, params={"tp_comm_buffer_name": "linear_attn"})
    qk_norm = _LOCAL.layer_norm(for_qk=True) if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=_LOCAL.column_parallel_linear(),
            core_attention=_LOCAL.core_attention(),
            linear_proj=_LOCAL.row_parallel_linear(),
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def _mlp_spec(mlp: MLPConfig) -> ModuleSpec:
    if mlp.no_op:
        return ModuleSpec(module=IdentityOp)
    if mlp.replace_with_linear:
        return ModuleSpec(module=ColumnParallelLinearGathered, params={"tp_comm_buffer_name": "linear_mlp"})
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=_LOCAL.column_parallel_linear(),
                                                           linear_fc2=_LOCAL.row_parallel_linear()))


def _sharded_state_dict_keys_map(block: TransformerBlockConfig) -> dict[str, str]:
    """Megatron-Core's checkpoint names of the separate norms (its rule, kept for checkpoint compatibility)."""
    keys_map = {}
    if block.attention.num_query_groups is not None:
        keys_map.update(INPUT_NORM_KEY)
    if block.attention.replace_with_linear:
        keys_map["input_layernorm."] = "self_attention.layer_norm_"
    if block.mlp.ffn_hidden_size is not None:
        keys_map.update(PRE_MLP_NORM_KEY)
    if block.mlp.replace_with_linear:
        keys_map["pre_mlp_layernorm."] = "mlp.layer_norm_"
    return keys_map


def _layer_spec(block: TransformerBlockConfig, qk_layernorm: bool) -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_norm(block.attention),
            self_attention=_attention_spec(block.attention, qk_layernorm),
            self_attn_bda=IdentityFuncOp if block.attention.no_op else get_bias_dropout_add,
            pre_mlp_layernorm=_norm(block.mlp),
            mlp=_mlp_spec(block.mlp),
            mlp_bda=IdentityFuncOp if block.mlp.no_op else get_bias_dropout_add,
            sharded_state_dict_keys_map=_sharded_state_dict_keys_map(block),
        ),
    )


def get_gpt_heterogeneous_layer_spec(
    config: HeterogeneousTransformerConfig,
    use_te: bool = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """The layer specs of this pipeline chunk (``vp_stage`` / ``pp_rank``, default: this rank's) and the
    final norm. ``use_te=True`` needs Transformer Engine layers, which this library does not provide."""
    if not isinstance(config, HeterogeneousTransformerConfig):
        raise TypeError(f"get_gpt_heterogeneous_layer_spec needs a HeterogeneousTransformerConfig, "
                        f"got {type(config).__name__}")
    if use_te:
        _te_spec_provider()
    specs = [_layer_spec(block, config.qk_layernorm) for block in config.per_block_parameters]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count], layer_norm=_LOCAL.layer_norm())
