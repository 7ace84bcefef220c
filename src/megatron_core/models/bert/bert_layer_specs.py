"""Layer specs for BERT (Megatron-Core's ``models.bert.bert_layer_specs``).

A BERT layer is a pre-norm ``TransformerLayer`` whose self-attention uses a padding mask (no causal
mask). As in Megatron-Core, the local spec is a module-level object, ``bert_layer_local_spec``
(PyTorch norms and this library's tensor-parallel layers). The Transformer Engine spec comes from
:func:`get_bert_layer_with_transformer_engine_spec`, and the old module attribute
``bert_layer_with_transformer_engine_spec`` still resolves to it, with a deprecation warning.
Both are built from a backend spec provider (``LocalSpecProvider``, ``TESpecProvider``), as GPT's are.
The Transformer Engine classes are the wrappers of :mod:`megatron_core.extensions.transformer_engine`, which
import without Transformer Engine: the spec can always be built and imported, and building a model
from it without Transformer Engine raises the ``ImportError`` naming the ``te`` extra.
"""

from __future__ import annotations

import warnings

from megatron_core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron_core.transformer.backend_specs import (
    dense_mlp_spec,
    pre_norm_layer_submodules,
    self_attention_spec,
)
from megatron_core.transformer.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "bert_layer_local_spec",
    "get_bert_layer_with_transformer_engine_spec",
    "get_bert_layer_with_transformer_engine_submodules",
]

LNImpl = LocalSpecProvider().layer_norm()


def _bert_layer_submodules(backend: BackendSpecProvider, qk_layernorm: type | None) -> TransformerLayerSubmodules:
    """A BERT layer from ``backend``'s parts: padding-masked self-attention and a dense MLP, each after its norm."""
    return pre_norm_layer_submodules(backend, self_attention_spec(backend, AttnMaskType.padding, qk_layernorm),
                                     dense_mlp_spec(backend))


def get_bert_layer_with_transformer_engine_submodules() -> TransformerLayerSubmodules:
    """The submodules of a BERT layer on Transformer Engine modules (each pre-norm fused into the next linear).

    The q/k norm slots stay ``None``, so ``config.qk_layernorm`` picks its default norm, as in Megatron-Core.
    """
    return _bert_layer_submodules(TESpecProvider(), qk_layernorm=None)


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
    module=TransformerLayer, submodules=_bert_layer_submodules(LocalSpecProvider(), qk_layernorm=IdentityOp))
"""Pure PyTorch + this library's tensor-parallel layers (Megatron-Core's ``bert_layer_local_spec``)."""
