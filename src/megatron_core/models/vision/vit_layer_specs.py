"""Layer specs for vision transformers (Megatron-Core's ``vit_layer_specs``).

A ViT layer is a GPT-style pre-norm layer whose self-attention has no mask (every patch attends to
every patch). ``get_vit_layer_with_local_spec()`` is pure PyTorch plus this library's tensor-parallel
layers; ``get_vit_layer_with_transformer_engine_spec()`` asks for the Transformer Engine backend the
way the GPT specs do (``ImportError`` naming the ``te`` extra when it is missing). Both layouts give
the state-dict keys Megatron-Core's specs give.
"""

from __future__ import annotations

from megatron_core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.transformer.backend_specs import (
    dense_mlp_spec,
    pre_norm_layer_submodules,
    self_attention_spec,
)
from megatron_core.transformer.backends import te_spec_provider
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_layer import TransformerLayer

__all__ = ["get_vit_layer_with_local_spec", "get_vit_layer_with_transformer_engine_spec"]


def _vit_layer(backend: BackendSpecProvider) -> ModuleSpec:
    """A ``TransformerLayer`` with unmasked self-attention and a dense MLP, from ``backend``'s parts; the separate
    local norms keep their own checkpoint names, as in Megatron-Core's local ViT spec."""
    return ModuleSpec(module=TransformerLayer, submodules=pre_norm_layer_submodules(
        backend, self_attention_spec(backend, AttnMaskType.no_mask), dense_mlp_spec(backend), map_norm_keys=False))


def get_vit_layer_with_transformer_engine_spec() -> ModuleSpec:
    """A ViT layer on Transformer Engine modules (raises ``ImportError`` naming the ``te`` extra when missing)."""
    return _vit_layer(te_spec_provider())


def get_vit_layer_with_local_spec(*, backend: BackendSpecProvider | None = None) -> ModuleSpec:
    """A ViT layer from PyTorch and this library's TP layers; ``backend`` (an extension) swaps single parts."""
    return _vit_layer(backend or LocalSpecProvider())
