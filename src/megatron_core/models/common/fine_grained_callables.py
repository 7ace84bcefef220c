"""Which slot functions a layer's schedule nodes run (Megatron-Core's ``models.common.fine_grained_callables``).

``build_layer_callables`` picks the builder for the layer's type; ``get_layer_moe_metadata`` tells the
plan whether the layer has MoE dispatch and combine slots. Transformer layers (dense or MoE) are
supported; multi-token-prediction layers are not scheduled by this library's plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_core.models.gpt.fine_grained_callables import build_transformer_layer_callables
from megatron_core.transformer.moe.moe_layer import MoELayer
from megatron_core.transformer.transformer_layer import TransformerLayer

__all__ = ["build_layer_callables", "get_layer_moe_metadata"]


def get_layer_moe_metadata(layer: Any) -> tuple[bool, int | None]:
    """``(is_moe, num_local_experts)`` of a transformer layer (``None`` experts for a dense layer)."""
    if not isinstance(layer, TransformerLayer):
        raise ValueError(f"the combined 1F1B schedule plan supports TransformerLayer, got {type(layer).__name__}")
    if isinstance(layer.mlp, MoELayer):
        return True, layer.mlp.num_local_experts
    return False, None


def build_layer_callables(layer: Any) -> tuple[list[Callable | None], dict]:
    """``(forward_funcs, backward_dw)`` for ``layer``'s nodes (see ``build_transformer_layer_callables``)."""
    if not isinstance(layer, TransformerLayer):
        raise ValueError(f"the combined 1F1B schedule plan supports TransformerLayer, got {type(layer).__name__}")
    return build_transformer_layer_callables(layer)
