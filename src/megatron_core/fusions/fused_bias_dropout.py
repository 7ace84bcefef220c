"""Bias-dropout-add: ``residual + dropout(x + bias)`` (Megatron-Core's ``get_bias_dropout_add``).

Linear layers built with ``skip_bias_add=True`` return ``(output, bias)``; this adds the bias,
applies dropout and adds the residual in one expression that ``torch.compile`` fuses. Dropout
is skipped entirely (no mask, no copy) when the probability is 0 or the module is in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_core.jit import jit_fuser


def bias_dropout_add(
    x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(x + bias, prob)``; the result has the residual's dtype."""
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    if training and prob > 0.0:
        x = F.dropout(x, p=prob, training=True)
    if x.shape == residual.shape and x.dim() > 2:
        # The same sum taken over 2-D views: a GEMM's output added straight to the residual then matches Inductor's
        # mm + add pattern, so a compiled layer adds the residual in cuBLAS's epilogue (addmm) instead of a kernel
        # of its own that rereads the GEMM's output.
        hidden = residual.shape[-1]
        return (residual.reshape(-1, hidden) + x.reshape(-1, hidden)).view(residual.shape)
    return residual + x


def get_bias_dropout_add(training: bool, fused: bool = False) -> Callable[..., torch.Tensor]:
    """A function ``(x_with_bias, residual, prob) -> tensor`` for train or eval mode.

    ``fused`` is accepted for Megatron compatibility; the same expression is used either way
    (``torch.compile`` does the fusion).
    """

    def _bias_dropout_add(
        x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor, prob: float
    ) -> torch.Tensor:
        return bias_dropout_add(x_with_bias, residual, prob, training)

    return _bias_dropout_add


# The train/inference variants Megatron-Core also names in this module.
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


__all__ = ["bias_dropout_add", "bias_dropout_add_fused_inference", "bias_dropout_add_fused_train",
           "bias_dropout_add_unfused", "get_bias_dropout_add"]
