"""The latent projections of a latent MoE layer (``moe_latent_size``): ``fc1_latent_proj`` and ``fc2_latent_proj``.

Tokens are projected from ``hidden_size`` down to ``moe_latent_size`` before they are dispatched, the routed
experts work in the latent space, and the combined output is projected back up. Megatron-Core builds both as
Transformer Engine linears in "duplicated" mode: the full weight on every rank, no tensor-parallel split. Under
sequence parallelism each rank projects its own tokens, so the weights are marked ``sequence_parallel`` and their
gradients are summed over the tensor-parallel group (as the router's are).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["LatentProjection"]


class LatentProjection(MegatronModule):
    """A replicated linear ``y = x W^T (+ b)`` with ``weight [output_size, input_size]``; returns ``(y, None)``."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig, init_method: Any,
                 bias: bool, tp_group: Any = None) -> None:
        super().__init__(config)
        self.tp_group = tp_group  # replicated over it (checkpoint replica ids)
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=torch.float32))
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=torch.float32)) if bias else None
        if config.perform_initialization:
            init_method(self.weight)
        for param in (self.weight, self.bias):
            if param is not None:
                param.data = param.data.to(config.params_dtype)
                param.sequence_parallel = config.sequence_parallel

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``(input @ weight.T + bias, None)`` for ``input [..., input_size]``."""
        return torch.nn.functional.linear(input, self.weight, self.bias), None

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored (the key exists for Transformer Engine checkpoint compatibility)."""

    def get_extra_state(self) -> None:
        """No extra state (the key exists for Transformer Engine checkpoint compatibility)."""
        return None
