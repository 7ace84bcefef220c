"""An MLP-only layer of a hybrid stack (Megatron-Core's ``MLPLayer``, the ``-`` pattern symbol).

A :class:`TransformerLayer` whose spec fills only ``pre_mlp_layernorm``, ``mlp`` and ``mlp_bda``;
the attention slots stay identities.
"""

from __future__ import annotations

from typing import Any

from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["MLPLayer"]


class MLPLayer(TransformerLayer):
    """A transformer layer built from a spec that holds only the MLP part."""

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: float | None = None, pg_collection: Any = None, add_layer_offset: bool = True,
                 name: str | None = None) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         add_layer_offset=add_layer_offset, name=name)
