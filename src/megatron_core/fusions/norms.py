"""LayerNorm and RMSNorm modules on ``torch.nn.functional`` (what Megatron-Core's ``WrappedTorchNorm`` builds).

:class:`~megatron_core.transformer.torch_norm.WrappedTorchNorm` picks one by ``config.normalization``;
``FusedLayerNorm`` is the layer norm under Megatron-Core's apex name. ``config`` is a ``ModelParallelConfig``
(typed here by its base, ``ModelParallelConfig``: this layer sits below ``transformer``). Parameters keep Megatron's names (``weight``, ``bias``) and carry ``sequence_parallel`` so that
their gradients are all-reduced over the tensor-parallel group under sequence parallelism.
With ``layernorm_zero_centered_gamma`` the stored weight is ``gamma - 1`` (initialised to 0).
With ``gradient_accumulation_fusion`` under DDP the backward adds the parameters' gradients to their ``main_grad``
itself (:func:`~megatron_core.tensor_parallel.wgrad_accumulation.gradient_into_main_grad`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.fusions.fused_rms_norm import rms_norm_with_residual
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel.wgrad_accumulation import (
    gradient_into_main_grad,
    mark_gradient_into_main_grad,
)


def norm_parameter(hidden_size: int, config: ModelParallelConfig, ones: bool) -> torch.nn.Parameter:
    """A norm's scale (``ones``) or shift: marked ``sequence_parallel`` and, with gradient-accumulation fusion, for
    accumulation into ``main_grad``."""
    init = torch.ones if ones else torch.zeros
    param = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
    param.sequence_parallel = config.sequence_parallel
    if config.gradient_accumulation_fusion:
        mark_gradient_into_main_grad(param)
    return param


class LayerNorm(torch.nn.Module):
    """Layer normalization with a learned scale and shift over the last dimension."""

    def __init__(self, config: ModelParallelConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = norm_parameter(hidden_size, config, ones=not self.zero_centered_gamma)
        self.bias = norm_parameter(hidden_size, config, ones=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` over its last dimension."""
        weight = gradient_into_main_grad(self.weight)
        weight = weight + 1 if self.zero_centered_gamma else weight
        return F.layer_norm(x, self.hidden_size, weight, gradient_into_main_grad(self.bias), self.eps)


class RMSNorm(torch.nn.Module):
    """Root-mean-square normalization with a learned scale over the last dimension."""

    def __init__(self, config: ModelParallelConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = norm_parameter(hidden_size, config, ones=not self.zero_centered_gamma)

    # forward(x, return_residual=True) returns (y, x) from one autograd node (TransformerLayer's pre-norm residual).
    returns_residual = True

    def forward(self, x: torch.Tensor, return_residual: bool = False) -> torch.Tensor | tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
        """Normalize ``x`` over its last dimension; with ``return_residual`` return ``(y, x)``.

        Using that second output as the residual lets one backward (a Triton kernel on CUDA) add both gradients.
        """
        weight = gradient_into_main_grad(self.weight)
        weight = weight + 1 if self.zero_centered_gamma else weight
        if return_residual:
            return rms_norm_with_residual(x, weight, self.eps)
        return F.rms_norm(x, self.hidden_size, weight, self.eps)


__all__ = ["LayerNorm", "RMSNorm", "norm_parameter"]
