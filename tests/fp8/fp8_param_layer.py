"""A stand-in for a converted FP8-parameter layer in the FP8 tests: the attributes ``fp8_param_matmul`` reads."""

from __future__ import annotations

import torch

from megatron_core.distributed.fp8_params import make_fp8_param
from megatron_core.fp8.fp8_param_linear import fp8_param_matmul


class OneFP8WeightLayer(torch.nn.Module):
    """``x @ weight.T`` through ``fp8_param_matmul`` around one ``[32, 48]`` FP8 weight (emulated, e5m2 gradients)."""

    is_first_microbatch: bool | None = None  # as the converted layers: no cached transpose until a step says so

    def __init__(self) -> None:
        super().__init__()
        self.weight = make_fp8_param(torch.nn.Parameter(torch.randn(32, 48) * 0.05))
        self.fp8_param_grad_dtype = torch.float8_e5m2
        self.fp8_param_amax_group = None
        self.float8_emulate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_param_matmul(x, self.weight, self)
