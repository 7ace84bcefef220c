"""Element-wise activation functions used by MLPs (Megatron-Core's ``activations``), and the gated linear unit."""

from __future__ import annotations

from collections.abc import Callable

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


def gated_linear_unit(x: torch.Tensor, activation_func: Callable[[torch.Tensor], torch.Tensor],
                      linear_offset: float = 0.0, clamp_value: float | None = None) -> torch.Tensor:
    """``activation_func(gate) * (up + linear_offset)`` on the halves ``[gate; up]`` of ``x``'s last dimension.

    With ``clamp_value`` ``v`` (GPT-OSS), ``gate`` is first clamped to at most ``v`` and ``up`` to ``[-v, v]``,
    as Megatron-Core's ``activation_func_clamp_value`` does.
    """
    gate, up = torch.chunk(x, 2, dim=-1)
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        up = up.clamp(min=-clamp_value, max=clamp_value)
    if linear_offset != 0.0:
        up = up + linear_offset
    return activation_func(gate) * up
