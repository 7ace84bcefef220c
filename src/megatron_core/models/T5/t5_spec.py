"""Layer and block specs for the T5 encoder and decoder (Megatron-Core's ``models.T5.t5_spec``).

The encoder layer is self-attention + MLP; the decoder layer adds a cross-attention sublayer
(``pre_cross_attn_layernorm``, ``cross_attention``, ``cross_attn_bda``) between them. Both layouts are
built from a backend spec provider, as GPT's are: the local specs from ``LocalSpecProvider`` (this
library's tensor-parallel linears, ``DotProductAttention``, ``WrappedTorchNorm``), the Transformer
Engine specs from ``TESpecProvider`` (the wrappers of :mod:`megatron_core.extensions.transformer_engine`);
those raise ``ImportError`` naming the ``te`` extra when Transformer Engine is not installed.
"""

from __future__ import annotations

from megatron_core.extensions._te_loader import import_te
from megatron_core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron_core.transformer.backend_specs import (
    cross_attention_spec,
    dense_mlp_spec,
    pre_norm_layer_submodules,
    self_attention_spec,
)
from megatron_core.transformer.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_block import TransformerBlockSubmodules
from megatron_core.transformer.transformer_layer import TransformerLayer

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

def _te_backend(what: str) -> BackendSpecProvider:
    """The Transformer Engine provider, after checking that Transformer Engine is installed."""
    import_te(what)
    return TESpecProvider()


def _encoder_layer(backend: BackendSpecProvider, mask_type: AttnMaskType) -> ModuleSpec:
    """An encoder layer from ``backend``'s parts: self-attention under ``mask_type`` and a dense MLP."""
    return ModuleSpec(module=TransformerLayer, submodules=pre_norm_layer_submodules(
        backend, self_attention_spec(backend, mask_type, IdentityOp), dense_mlp_spec(backend)))


def _decoder_layer(backend: BackendSpecProvider, cross_mask_type: AttnMaskType) -> ModuleSpec:
    """A decoder layer from ``backend``'s parts: causal self-attention, cross-attention under ``cross_mask_type``
    and a dense MLP."""
    return ModuleSpec(module=TransformerLayer, submodules=pre_norm_layer_submodules(
        backend, self_attention_spec(backend, AttnMaskType.causal, IdentityOp), dense_mlp_spec(backend),
        cross_attention=cross_attention_spec(backend, cross_mask_type)))


def encoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """The T5 encoder layer on Transformer Engine: padding-masked self-attention and MLP, norms fused into the
    following linear layers."""
    return _encoder_layer(_te_backend("encoder_model_with_transformer_engine_default_spec"), AttnMaskType.padding)


def decoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """The T5 decoder layer on Transformer Engine: causal self-attention, padding-masked cross-attention, MLP."""
    return _decoder_layer(_te_backend("decoder_model_with_transformer_engine_default_spec"), AttnMaskType.padding)


def encoder_model_with_local_spec() -> ModuleSpec:
    """The T5 encoder layer on local layers: norm, self-attention under an arbitrary mask, norm, MLP."""
    return _encoder_layer(LocalSpecProvider(), AttnMaskType.arbitrary)


def decoder_model_with_local_spec() -> ModuleSpec:
    """The T5 decoder layer on local layers: causal self-attention, cross-attention under an arbitrary mask, MLP,
    each after its own norm."""
    return _decoder_layer(LocalSpecProvider(), AttnMaskType.arbitrary)


def _check_num_layers(num_layers: int) -> None:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers ({num_layers!r}) must be a positive integer")


def get_t5_encoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Transformer Engine encoder layers and a final ``TENorm``."""
    _check_num_layers(num_layers)
    norm = _te_backend("get_t5_encoder_with_transformer_engine_block_spec").layer_norm()
    return TransformerBlockSubmodules([encoder_model_with_transformer_engine_default_spec()] * num_layers,
                                      layer_norm=norm)


def get_t5_decoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` Transformer Engine decoder layers and a final ``TENorm``."""
    _check_num_layers(num_layers)
    norm = _te_backend("get_t5_decoder_with_transformer_engine_block_spec").layer_norm()
    return TransformerBlockSubmodules([decoder_model_with_transformer_engine_default_spec()] * num_layers,
                                      layer_norm=norm)


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` local encoder layers and a final ``WrappedTorchNorm`` (Megatron-Core names ``TENorm`` here,
    which is absent without Transformer Engine; the local norm computes the same and has the same keys)."""
    _check_num_layers(num_layers)
    return TransformerBlockSubmodules([encoder_model_with_local_spec()] * num_layers,
                                      layer_norm=LocalSpecProvider().layer_norm())


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` local decoder layers and a final ``WrappedTorchNorm`` (see the encoder's)."""
    _check_num_layers(num_layers)
    return TransformerBlockSubmodules([decoder_model_with_local_spec()] * num_layers,
                                      layer_norm=LocalSpecProvider().layer_norm())
