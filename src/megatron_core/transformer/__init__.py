"""Transformer building blocks: config, specs, attention, MLP, layers and blocks (``megatron.core.transformer``)."""

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.fusions.norms import LayerNorm, RMSNorm
from megatron_core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnBackend, AttnMaskType, AttnType, LayerType, ModelType
from megatron_core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.module import Float16Module, MegatronModule
from megatron_core.transformer.pipeline_layout import (
    PipelineParallelLayerLayout,
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron_core.transformer.spec_utils import ModuleSpec, build_module, get_submodules, import_module
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron_core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "AttnBackend",
    "AttnMaskType",
    "AttnType",
    "DotProductAttention",
    "Float16Module",
    "IdentityFuncOp",
    "IdentityOp",
    "LayerNorm",
    "LayerType",
    "MLATransformerConfig",
    "MLP",
    "MLPSubmodules",
    "MegatronModule",
    "ModelType",
    "ModuleSpec",
    "PipelineParallelLayerLayout",
    "RMSNorm",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TransformerBlock",
    "TransformerBlockSubmodules",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "WrappedTorchNorm",
    "build_module",
    "get_bias_dropout_add",
    "get_num_layers_to_build",
    "get_submodules",
    "get_transformer_layer_offset",
    "import_module",
]
