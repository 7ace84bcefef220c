"""``WrappedTorchNorm`` (Megatron-Core's ``transformer.torch_norm``): builds the norm ``config.normalization`` names.

The norm modules themselves, :class:`LayerNorm` and :class:`RMSNorm`, live in :mod:`megatron_core.fusions.norms`.
:class:`L2Norm` is the parameter-free RMS normalisation used on queries and keys (``qk_l2_norm``);
:class:`LayerNormInterface` and :class:`LayerNormBuilder` are the typing protocols a norm and a norm factory meet.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from megatron_core.fusions.norms import LayerNorm, RMSNorm
from megatron_core.transformer.transformer_config import TransformerConfig


class LayerNormInterface(Protocol):
    """What a norm module offers: ``forward(x)`` returning the normalised ``x``."""

    def forward(self, x: torch.Tensor, /) -> torch.Tensor:
        """The normalised ``x``."""
        ...


class LayerNormBuilder(Protocol):
    """What builds a norm: called with keyword ``config``, ``hidden_size`` and ``eps`` (as ``WrappedTorchNorm``)."""

    def __call__(self, *, config: TransformerConfig, hidden_size: int, eps: float) -> LayerNormInterface:
        """A norm over ``hidden_size`` features."""
        ...


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


class L2Norm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, in fp32, returned in ``x``'s dtype; no parameters.

    ``hidden_size`` is recorded only; extra keyword arguments (a norm builder's ``config``) are accepted and
    ignored, as in Megatron-Core.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs: object) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised ``x``."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


__all__ = ["L2Norm", "LayerNorm", "LayerNormBuilder", "LayerNormInterface", "RMSNorm", "WrappedTorchNorm"]
