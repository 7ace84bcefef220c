"""Bias + dropout + residual add (Megatron-Core's ``fused_bias_dropout``).

The one implementation lives in :mod:`megatron_core.transformer.bias_dropout_add`; this module gives
Megatron's names: ``get_bias_dropout_add`` and the train/inference variants.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_core.jit import jit_fuser
from megatron_core.transformer.bias_dropout_add import bias_dropout_add, get_bias_dropout_add

_XWithBias = tuple[torch.Tensor, "torch.Tensor | None"]


def bias_dropout_add_unfused(training: bool) -> Callable[[_XWithBias, torch.Tensor, float], torch.Tensor]:
    """``(x_with_bias, residual, prob) -> residual + dropout(x + bias)`` for train or eval mode."""
    return get_bias_dropout_add(training, fused=False)


@jit_fuser
def bias_dropout_add_fused_train(x_with_bias: _XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    """``residual + dropout(x + bias, prob)`` in training mode."""
    return bias_dropout_add(x_with_bias, residual, prob, True)


@jit_fuser
def bias_dropout_add_fused_inference(x_with_bias: _XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    """``residual + x + bias`` (no dropout: inference mode)."""
    return bias_dropout_add(x_with_bias, residual, prob, False)


__all__ = ["bias_dropout_add_fused_inference", "bias_dropout_add_fused_train", "bias_dropout_add_unfused",
           "get_bias_dropout_add"]
