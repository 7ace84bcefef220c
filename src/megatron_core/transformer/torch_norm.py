"""LayerNorm and RMSNorm on ``torch.nn.functional`` (Megatron-Core's ``WrappedTorchNorm``).

``WrappedTorchNorm(config, hidden_size, eps)`` builds the norm ``config.normalization`` names.
Parameters keep Megatron's names (``weight``, ``bias``) and carry ``sequence_parallel`` so that
their gradients are all-reduced over the tensor-parallel group under sequence parallelism.
With ``layernorm_zero_centered_gamma`` the stored weight is ``gamma - 1`` (initialised to 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.transformer.transformer_config import TransformerConfig


def _make_weight(hidden_size: int, zero_centered: bool, sequence_parallel: bool, dtype: torch.dtype) -> torch.nn.Parameter:
    init = torch.zeros if zero_centered else torch.ones
    weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
    weight.sequence_parallel = sequence_parallel
    return weight


class LayerNorm(torch.nn.Module):
    """Layer normalization with a learned scale and shift over the last dimension."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        sp = config.sequence_parallel
        self.weight = _make_weight(hidden_size, self.zero_centered_gamma, sp, config.params_dtype)
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.bias.sequence_parallel = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` over its last dimension."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.layer_norm(x, self.hidden_size, weight, self.bias, self.eps)


class RMSNorm(torch.nn.Module):
    """Root-mean-square normalization with a learned scale over the last dimension."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = _make_weight(hidden_size, self.zero_centered_gamma, config.sequence_parallel, config.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` over its last dimension."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.rms_norm(x, self.hidden_size, weight, self.eps)


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
