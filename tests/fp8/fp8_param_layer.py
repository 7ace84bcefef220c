"""Shared pieces of the FP8 tests: a stand-in for a converted FP8-parameter layer (the attributes
``fp8_param_matmul`` reads) and an emulated-FP8 model under DDP with the distributed optimizer."""

from __future__ import annotations

import torch

from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.distributed.fp8_params import make_fp8_param
from megatron_core.fp8 import convert_to_float8
from megatron_core.fp8.fp8_param_linear import fp8_param_matmul
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer


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


def emulated_fp8_ddp(model: torch.nn.Module, fp8_param: bool, lr: float = 1e-2) -> tuple[torch.nn.Module, object]:
    """``model`` converted to emulated FP8, wrapped in DDP with the distributed optimizer (FP8 parameter all-gather
    with ``fp8_param``); returns ``(ddp, optimizer)``."""
    convert_to_float8(model, emulate=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
    return ddp, get_megatron_optimizer(OptimizerConfig(lr=lr, use_distributed_optimizer=True), [ddp])
