"""Element-wise activation functions used by MLPs (Megatron-Core's ``activations``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.jit import jit_fuser


@jit_fuser
def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (Primer's squared ReLU)."""
    return torch.pow(F.relu(x), 2)


@jit_fuser
def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid approximation of GELU: ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


@jit_fuser
def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """Tanh approximation of GELU: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * x * (1.0 + 0.044715 * x * x)))
