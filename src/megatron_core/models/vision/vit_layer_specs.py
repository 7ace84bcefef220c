"""Layer specs for vision transformers (Megatron-Core's ``vit_layer_specs``).

A ViT layer is a GPT-style pre-norm layer whose self-attention has no mask (every patch attends to
every patch). ``get_vit_layer_with_local_spec()`` is pure PyTorch plus this library's tensor-parallel
layers; ``get_vit_layer_with_transformer_engine_spec()`` asks for the Transformer Engine backend the
way the GPT specs do (``ImportError`` naming the ``te`` extra when it is missing). Both layouts give
the state-dict keys Megatron-Core's specs give.
"""

from __future__ import annotations

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.models.gpt.gpt_layer_specs import _te_spec_provider, get_mlp_module_spec_for_backend
from megatron_core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["get_vit_layer_with_local_spec", "get_vit_layer_with_transformer_engine_spec"]


def _vit_layer(backend: BackendSpecProvider) -> ModuleSpec:
    """A ``TransformerLayer`` with unmasked self-attention and a dense MLP, from ``backend``'s parts."""
    fused = backend.fuse_layernorm_and_linear()
    norm = IdentityOp if fused else backend.layer_norm()
    linear_qkv = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear_qkv,
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec_for_backend(backend),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_vit_layer_with_transformer_engine_spec() -> ModuleSpec:
    """A ViT layer on Transformer Engine modules (raises ``ImportError`` naming the ``te`` extra when missing)."""
    return _vit_layer(_te_spec_provider())


def get_vit_layer_with_local_spec(*, backend: BackendSpecProvider | None = None) -> ModuleSpec:
    """A ViT layer from PyTorch and this library's TP layers; ``backend`` (an extension) swaps single parts."""
    return _vit_layer(backend or LocalSpecProvider())
