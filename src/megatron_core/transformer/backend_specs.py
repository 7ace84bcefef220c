"""Spec building blocks taken from a backend provider: self- and cross-attention, the dense MLP, a pre-norm layer.

The layer specs of every model (GPT, BERT, T5, ViT, hybrid) build their parts here from a
:class:`~megatron_core.transformer.backends.BackendSpecProvider`, so one rule decides how a pre-norm
meets the linear layer after it: a backend that fuses them (Transformer Engine) gets its fused norm +
linear and no separate norm; any other gets a separate norm, stored in checkpoints under the fused
module's name through ``sharded_state_dict_keys_map``
(:func:`~megatron_core.transformer.backends.fused_norm_keys_map`), so both layouts share checkpoints.
"""

from __future__ import annotations

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.transformer.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron_core.transformer.backends import BackendSpecProvider, fused_norm_keys_map
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_layer import TransformerLayerSubmodules

__all__ = [
    "cross_attention_spec",
    "dense_mlp_spec",
    "norm_keys_map",
    "norm_linear",
    "pre_norm",
    "pre_norm_layer_submodules",
    "self_attention_spec",
]


def pre_norm(backend: BackendSpecProvider) -> type:
    """The norm before a column-parallel linear: ``IdentityOp`` where ``backend`` fuses it into that linear."""
    return IdentityOp if backend.fuse_layernorm_and_linear() else backend.layer_norm()


def norm_linear(backend: BackendSpecProvider) -> type:
    """The column-parallel linear after a pre-norm: ``backend``'s fused norm + linear where it fuses them."""
    fused = backend.column_parallel_layer_norm_linear() if backend.fuse_layernorm_and_linear() else None
    return fused or backend.column_parallel_linear()


def norm_keys_map(backend: BackendSpecProvider, keys_map: dict[str, str] | None = None) -> dict[str, str]:
    """A layer's ``sharded_state_dict_keys_map``: none for a fusing ``backend``, else (a copy of) ``keys_map``,
    by default both norms' :func:`~megatron_core.transformer.backends.fused_norm_keys_map`."""
    if backend.fuse_layernorm_and_linear():
        return {}
    return dict(fused_norm_keys_map() if keys_map is None else keys_map)


def self_attention_spec(backend: BackendSpecProvider, attn_mask_type: AttnMaskType,
                        qk_layernorm: type | None = None) -> ModuleSpec:
    """``SelfAttention`` under ``attn_mask_type`` from ``backend``'s parts (QKV after the pre-norm);
    ``qk_layernorm`` fills both q/k norm slots (``None`` leaves them to the config)."""
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": attn_mask_type},
        submodules=SelfAttentionSubmodules(
            linear_qkv=norm_linear(backend),
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_layernorm,
            k_layernorm=qk_layernorm,
        ),
    )


def cross_attention_spec(backend: BackendSpecProvider, attn_mask_type: AttnMaskType) -> ModuleSpec:
    """``CrossAttention`` under ``attn_mask_type``: plain column-parallel q and kv projections (its norm stays
    separate, ``pre_cross_attn_layernorm``)."""
    linear = backend.column_parallel_linear()
    return ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": attn_mask_type},
        submodules=CrossAttentionSubmodules(linear_q=linear, linear_kv=linear, core_attention=backend.core_attention(),
                                            linear_proj=backend.row_parallel_linear()),
    )


def dense_mlp_spec(backend: BackendSpecProvider) -> ModuleSpec:
    """The dense ``MLP`` (fc1 after the pre-norm, fc2 row-parallel, ``backend``'s activation override)."""
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=norm_linear(backend), linear_fc2=backend.row_parallel_linear(),
                                 activation_func=backend.activation_func()),
    )


def pre_norm_layer_submodules(backend: BackendSpecProvider, self_attention: ModuleSpec | None = None,
                              mlp: ModuleSpec | None = None, cross_attention: ModuleSpec | None = None,
                              map_norm_keys: bool = True) -> TransformerLayerSubmodules:
    """The submodules of a pre-norm layer holding the given sublayers, each after its norm and followed by
    bias-dropout-add; slots of absent sublayers stay identities.

    The self-attention and MLP norms are :func:`pre_norm`; the cross-attention norm is always separate. With
    ``map_norm_keys`` (and a backend that keeps norms separate) the key map stores the self-attention and MLP
    norms under the fused modules' names; without it they keep their own names.
    """
    norm = pre_norm(backend)
    slots: dict = {}
    if self_attention is not None:
        slots.update(input_layernorm=norm, self_attention=self_attention, self_attn_bda=get_bias_dropout_add)
    if cross_attention is not None:
        slots.update(pre_cross_attn_layernorm=backend.layer_norm(), cross_attention=cross_attention,
                     cross_attn_bda=get_bias_dropout_add)
    if mlp is not None:
        slots.update(pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add)
    if map_norm_keys:
        keys = fused_norm_keys_map(attention=self_attention is not None, mlp=mlp is not None)
        slots["sharded_state_dict_keys_map"] = norm_keys_map(backend, keys)
    return TransformerLayerSubmodules(**slots)
