"""Squared ReLU times a per-token weight, with a hand-written backward (Megatron-Core's
``fusions.fused_weighted_squared_relu``): the MoE experts' activation when routing probabilities are applied
inside the experts."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.activations import squared_relu
from megatron_core.jit import jit_fuser

__all__ = ["WeightedSquaredReLUFunction", "uses_fused_weighted_squared_relu", "weighted_squared_relu",
           "weighted_squared_relu_back", "weighted_squared_relu_impl"]


@jit_fuser
def weighted_squared_relu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2 * weights`` (``weights`` broadcast over the hidden dimension), in ``x``'s dtype."""
    return (squared_relu(x) * weights).to(x.dtype)


@jit_fuser
def weighted_squared_relu_back(g: torch.Tensor, x: torch.Tensor, weights: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`weighted_squared_relu` with respect to ``x`` (``x``'s dtype) and ``weights`` (theirs,
    summed over the hidden dimension)."""
    grad_x = 2 * F.relu(x) * (g * weights)
    grad_w = (squared_relu(x) * g.to(weights.dtype)).sum(dim=-1, keepdim=True)
    return grad_x.to(x.dtype), grad_w.to(weights.dtype)


class WeightedSquaredReLUFunction(torch.autograd.Function):
    """``weighted_squared_relu`` saving only its inputs."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Compute the weighted activation, saving only the inputs."""
        ctx.save_for_backward(input, weights)
        return weighted_squared_relu(input, weights)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients for ``input`` and ``weights``."""
        input, weights = ctx.saved_tensors
        return weighted_squared_relu_back(grad_output, input, weights)


def weighted_squared_relu_impl(input: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``relu(input) ** 2 * weights`` for ``input`` ``[tokens, h]`` or ``[s, b, h]`` and one weight per token."""
    shape = input.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"weighted_squared_relu_impl: input must be 2-D or 3-D, got shape {tuple(shape)}")
    tokens = input.numel() // shape[-1]
    if weights.numel() != tokens:
        raise ValueError(f"weighted_squared_relu_impl: weights {tuple(weights.shape)} must hold one value per token "
                         f"({tokens} tokens in input {tuple(shape)})")
    out = WeightedSquaredReLUFunction.apply(input.reshape(-1, shape[-1]), weights.reshape(tokens, 1))
    return out if len(shape) == 2 else out.view(shape)


def uses_fused_weighted_squared_relu(config: Any, activation_func: Any) -> bool:
    """Whether an expert weights its squared-ReLU activation by the routing probabilities through
    :func:`weighted_squared_relu_impl` (``config.use_fused_weighted_squared_relu``, an ungated squared ReLU)."""
    return (bool(getattr(config, "use_fused_weighted_squared_relu", False)) and activation_func is squared_relu
            and not getattr(config, "gated_linear_unit", False))
