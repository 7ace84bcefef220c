"""Weight-init methods: normal, Megatron's scaled normal for output projections, and muP's variant."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init method that fills a tensor from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(multiplier * num_layers))^2), Megatron's init for output projections."""
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


def mup_scaled_init_method_normal(
    sigma: float, num_layers: int, width_mult: float, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / (sqrt(multiplier * num_layers) * sqrt(width_mult)))^2): muP's output-projection init."""
    return init_method_normal(sigma / (math.sqrt(multiplier * num_layers) * math.sqrt(width_mult)))
