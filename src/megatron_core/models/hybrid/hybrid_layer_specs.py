"""Layer specs of hybrid models (Megatron-Core's ``models.hybrid.hybrid_layer_specs``) on local modules.

Megatron-Core's specs use Transformer Engine (fused norm + linear); here each fused
``TELayerNormColumnParallelLinear`` becomes a separate norm plus a ``ColumnParallelLinear``, and
``sharded_state_dict_keys_map`` stores the norm under TE's fused checkpoint name, as
``get_gpt_layer_local_spec`` does. ``mamba_stack_spec`` and ``hybrid_stack_spec`` are the same spec.
"""

from __future__ import annotations

from megatron_core import tensor_parallel
from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron_core.ssm.hybrid_stack import HybridStack, HybridStackSubmodules
from megatron_core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron_core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron_core.ssm.mlp_layer import MLPLayer
from megatron_core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_core.transformer.backends import fused_norm_keys_map
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["hybrid_stack_spec", "mamba_stack_spec", "moe"]

_column = tensor_parallel.ColumnParallelLinear
_row = tensor_parallel.RowParallelLinear

# The MoE block of the ``E`` layers (8 local experts, no grouped GEMM; the config's MoE fields decide the rest).
moe = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)

hybrid_stack_spec = ModuleSpec(
    module=HybridStack,
    submodules=HybridStackSubmodules(
        mamba_layer=ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                norm=WrappedTorchNorm,
                mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=_column, out_proj=_row)),
                mamba_bda=get_bias_dropout_add,
                sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
            ),
        ),
        attention_layer=ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=WrappedTorchNorm,
                self_attention=ModuleSpec(
                    module=SelfAttention,
                    params={"attn_mask_type": AttnMaskType.causal},
                    submodules=SelfAttentionSubmodules(
                        linear_qkv=_column, core_attention=DotProductAttention, linear_proj=_row),
                ),
                self_attn_bda=get_bias_dropout_add,
                sharded_state_dict_keys_map=fused_norm_keys_map(mlp=False),
            ),
        ),
        mlp_layer=ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=WrappedTorchNorm,
                mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=_column, linear_fc2=_row)),
                mlp_bda=get_bias_dropout_add,
                sharded_state_dict_keys_map=fused_norm_keys_map(attention=False),
            ),
        ),
        moe_layer=ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=WrappedTorchNorm,
                mlp=moe,
                mlp_bda=get_bias_dropout_add,
            ),
        ),
    ),
)

mamba_stack_spec = hybrid_stack_spec
