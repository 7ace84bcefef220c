"""A linear layer every tensor-parallel rank holds whole (Transformer Engine's ``parallel_mode="duplicated"``).

Megatron-Core builds such layers from ``TELinear(parallel_mode="duplicated")`` (for example the DeepSeek sparse
attention indexer's projections); :class:`DuplicatedLinear` is the local form, with the parallel layers'
constructor and ``(output, bias)`` result. Its parameters are not split and not marked sequence-parallel: every
rank computes the same gradient, so the gradient finalisation need not sum them over TP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.device import get_current_device
from megatron_core.model_parallel_config import ModelParallelConfig

__all__ = ["DuplicatedLinear"]


class DuplicatedLinear(torch.nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[output_size, input_size]`` replicated on every TP rank.

    ``parallel_mode`` must be ``None`` or ``"duplicated"``; the communication arguments of the parallel layers
    (``gather_output``, ``tp_group``, ``tp_comm_buffer_name``, ``is_expert``, ...) are accepted and have no effect.
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool = False, gather_output: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False,
                 parallel_mode: str | None = "duplicated", tp_comm_buffer_name: str | None = None,
                 is_expert: bool = False, tp_group: Any = None, name: str | None = None) -> None:
        super().__init__()
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"DuplicatedLinear: parallel_mode ({parallel_mode!r}) must be None or 'duplicated'")
        if skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear: skip_weight_param_allocation=True is not supported (it owns its "
                             "weight)")
        self.config = config
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        device = torch.device("cpu") if config.use_cpu_initialization else get_current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                     device=device))
        self.bias = (torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device))
                     if bias else None)
        if config.perform_initialization:
            init_method(self.weight)
        for param in self.parameters():
            param.tensor_model_parallel = False
            param.sequence_parallel = False
            param.allreduce = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x W^T + b, None)``, or ``(x W^T, b)`` with ``skip_bias_add``."""
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None
