"""``WrappedTorchNorm`` (Megatron-Core's ``transformer.torch_norm``): builds the norm ``config.normalization`` names.

The norm modules themselves, :class:`LayerNorm` and :class:`RMSNorm`, live in :mod:`megatron_core.fusions.norms`.
"""

from __future__ import annotations

import torch

from megatron_core.fusions.norms import LayerNorm, RMSNorm
from megatron_core.transformer.transformer_config import TransformerConfig


class WrappedTorchNorm:
    """Builds :class:`LayerNorm` or :class:`RMSNorm` according to ``config.normalization``."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ) -> torch.nn.Module:
        kind = normalization or config.normalization
        if kind == "LayerNorm":
            return LayerNorm(config, hidden_size, eps)
        if kind == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        raise ValueError(f"normalization ({kind!r}) must be 'LayerNorm' or 'RMSNorm'")


__all__ = ["LayerNorm", "RMSNorm", "WrappedTorchNorm"]
