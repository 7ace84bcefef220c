"""``FusedLayerNorm`` (Megatron-Core's apex-backed layer norm), here on ``torch.nn.functional.layer_norm``.

Same constructor and parameters (``weight``, ``bias`` with ``sequence_parallel`` set) as Megatron's; the
``persist_layer_norm`` choice of apex kernel is accepted and has no effect. ``config`` is a
``TransformerConfig`` (typed by its base: this layer sits below ``transformer``).
"""

from __future__ import annotations

import torch

from megatron_core.fusions.norms import LayerNorm
from megatron_core.model_parallel_config import ModelParallelConfig


class FusedLayerNorm(LayerNorm):
    """Layer norm over the last dimension, honouring ``config.layernorm_zero_centered_gamma``."""

    def __init__(self, config: ModelParallelConfig, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = True, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm") -> None:
        if config.normalization != "LayerNorm":
            raise ValueError(f"FusedLayerNorm needs config.normalization='LayerNorm', got {config.normalization!r}")
        super().__init__(config, hidden_size, eps)
        self.persist_layer_norm = persist_layer_norm
        self.sequence_parallel = config.sequence_parallel

    def reset_parameters(self) -> None:
        """Weight to 1 (0 with zero-centred gamma), bias to 0."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            self.bias.zero_()


__all__ = ["FusedLayerNorm"]
