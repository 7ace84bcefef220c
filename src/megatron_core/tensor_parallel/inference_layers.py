"""Inference-optimized linear layers (Megatron-Core's ``tensor_parallel.inference_layers``) on the local layers.

Megatron-Core builds them on Transformer Engine and, for decode, on NVLS symmetric-memory collectives it
falls back from to NCCL when they cannot be used. Here they are subclasses of :class:`ColumnParallelLinear`,
:class:`RowParallelLinear` and :class:`DuplicatedLinear` with Megatron-Core's constructors and checkpoint keys
(TE's names: ``weight``, ``bias``, and ``layer_norm_weight`` / ``layer_norm_bias`` for the fused norm).

In training, or whenever autograd is recording, ``forward`` is the parent's. In eval mode with gradients off
it takes a forward-only path: the sequence-parallel layout of Megatron-Core's inference layers (TP > 1 needs
``sequence_parallel=True``, as there): the column layers all-gather ``[s/TP, b, h]`` along the sequence before
their GEMM, the row layer reduce-scatters its partial sums back to ``[s/TP, b, h]``, with the
:mod:`.mappings` collectives (NCCL on GPU, gloo on CPU). Unlike Megatron-Core's inference path, the bias is
applied (there it is dropped) and ``gather_output`` is honoured. Symmetric-memory all-reduce
(``symmetric_ar_type``) is refused by name; Megatron-Core's fused reduce-scatter + residual + RMSNorm +
all-gather hooks are kept and, as there without symmetric memory, leave the plain path in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._ground import get_pg_size
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel.duplicated_linear import DuplicatedLinear
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_core.tensor_parallel.wgrad_accumulation import mark_gradient_into_main_grad

__all__ = [
    "InferenceColumnParallelLinear",
    "InferenceLayerNormColumnParallelLinear",
    "InferenceLinear",
    "InferenceRowParallelLinear",
    "inference_all_gather_from_tensor_model_parallel_region",
    "inference_reduce_scatter_to_sequence_parallel_region",
]


def _forward_only(module: torch.nn.Module) -> bool:
    """Whether ``module`` takes the inference path: eval mode and autograd off."""
    return not module.training and not torch.is_grad_enabled()


def _check_sequence_parallel(name: str, config: Any, tp_group: Any) -> None:
    tp_size = get_pg_size(tp_group)
    if tp_size > 1 and not config.sequence_parallel:
        raise ValueError(f"{name} with tensor parallelism (TP={tp_size}) needs sequence_parallel=True (the "
                         "inference layers' all-gather / reduce-scatter layout, as in Megatron-Core)")


def _norm_parameter(size: int, config: Any, ones: bool) -> torch.nn.Parameter:
    """A norm scale (``ones``) or shift, replicated over TP and marked ``sequence_parallel`` like the local norms'."""
    param = torch.nn.Parameter((torch.ones if ones else torch.zeros)(size, dtype=config.params_dtype))
    param.sequence_parallel = config.sequence_parallel
    if config.gradient_accumulation_fusion:
        mark_gradient_into_main_grad(param)
    return param


def _gather_sequence(x: torch.Tensor, tp_group: Any) -> torch.Tensor:
    return x if get_pg_size(tp_group) == 1 else gather_from_sequence_parallel_region(x, group=tp_group)


class InferenceLinear(DuplicatedLinear):
    """Megatron-Core's ``InferenceLinear`` (a ``TELinear``): here the replicated linear, ``(x W^T + b, None)``.

    Megatron-Core builds it with ``parallel_mode="duplicated"`` (the MoE latent projections); ``parallel_mode``
    must be None or ``"duplicated"`` and ``symmetric_ar_type`` None (``ValueError`` naming them otherwise).
    """

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None, config: ModelParallelConfig,
                 init_method: Callable, bias: bool, skip_bias_add: bool, skip_weight_param_allocation: bool,
                 tp_comm_buffer_name: str | None = None, is_expert: bool = False,
                 symmetric_ar_type: str | None = None, tp_group: Any = None, name: str | None = None) -> None:
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"InferenceLinear: parallel_mode ({parallel_mode!r}) must be None or 'duplicated' "
                             "(use InferenceColumnParallelLinear / InferenceRowParallelLinear for split weights)")
        if symmetric_ar_type is not None:
            raise ValueError(f"InferenceLinear: symmetric_ar_type ({symmetric_ar_type!r}) needs symmetric-memory "
                             "all-reduce, which this library does not provide; pass None")
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
                         parallel_mode=parallel_mode, tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert,
                         tp_group=tp_group, name=name)


class InferenceColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linear whose inference path all-gathers ``[s/TP, b, h]`` inputs (see the module docstring)."""

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool, stride: int = 1,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: str | None = None,
                 tp_group: Any = None, name: str | None = None) -> None:
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         gather_output=gather_output, stride=stride, skip_bias_add=skip_bias_add,
                         skip_weight_param_allocation=skip_weight_param_allocation, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, name=name)
        _check_sequence_parallel(type(self).__name__, config, self.tp_group)
        self.tp_size = get_pg_size(self.tp_group)

    def _inference_matmul(self, x: torch.Tensor, weight: torch.Tensor,
                          runtime_gather_output: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GEMM of the already gathered ``x``, the bias, and the optional last-dim gather."""
        output = F.linear(x, weight, None if self.skip_bias_add else self.bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.tp_size > 1:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.output_dtype is not None:
            output = output.to(self.output_dtype)
        return output, (self.bias if self.skip_bias_add else None)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        """``(output [s, b, out/TP], bias)``; the parent's forward in training or under autograd."""
        if not _forward_only(self):
            return super().forward(input_, weight, runtime_gather_output)
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("weight must be passed to forward() when skip_weight_param_allocation=True")
        return self._inference_matmul(_gather_sequence(input_, self.tp_group), weight, runtime_gather_output)


class InferenceLayerNormColumnParallelLinear(InferenceColumnParallelLinear):
    """The norm of ``config.normalization`` fused in front of :class:`InferenceColumnParallelLinear`.

    Parameters ``layer_norm_weight`` (and ``layer_norm_bias`` for ``LayerNorm``), replicated over TP and marked
    ``sequence_parallel``, then the column layer's ``weight`` / ``bias``. ``layernorm_zero_centered_gamma`` stores
    ``gamma - 1``. The norm runs on each rank's ``[s/TP, b, h]`` before the gather, in both paths.
    ``skip_norm_and_all_gather`` (Megatron-Core's hook for its fused NVLS path) must stay False.
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool, stride: int = 1,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: str | None = None,
                 tp_group: Any = None, name: str | None = None) -> None:
        super().__init__(input_size, output_size, config=config, init_method=init_method, gather_output=gather_output,
                         bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert, stride=stride,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, name=name)
        self.normalization = getattr(config, "normalization", "LayerNorm")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization ({self.normalization!r}) must be 'LayerNorm' or 'RMSNorm'")
        self.eps = getattr(config, "layernorm_epsilon", 1e-5)
        self.zero_centered_gamma = getattr(config, "layernorm_zero_centered_gamma", False)
        self.layer_norm_weight = _norm_parameter(input_size, config, ones=not self.zero_centered_gamma)
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = _norm_parameter(input_size, config, ones=False)
        else:
            self.register_parameter("layer_norm_bias", None)
        self.skip_norm_and_all_gather = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        """``(output [s, b, out/TP], bias)`` of the normalised input."""
        if self.skip_norm_and_all_gather:
            raise ValueError("skip_norm_and_all_gather=True needs Megatron-Core's fused NVLS reduce-scatter + "
                             "RMSNorm + all-gather, which this library does not provide")
        return super().forward(self._norm(input_), weight, runtime_gather_output)


class InferenceRowParallelLinear(RowParallelLinear):
    """Row-parallel linear whose inference path reduce-scatters to ``[s/TP, b, h]`` (see the module docstring).

    ``_set_next_layer_norm_weights`` / ``_set_residual`` (Megatron-Core's fused NVLS reduce-scatter + residual +
    RMSNorm + all-gather) are stored and, as in Megatron-Core without symmetric memory, not used.
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool, input_is_parallel: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: str | None = None, tp_group: Any = None, name: str | None = None) -> None:
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, name=name)
        _check_sequence_parallel(type(self).__name__, config, self.tp_group)
        self.tp_size = get_pg_size(self.tp_group)
        self.next_layer_norm_weights: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None

    def _set_next_layer_norm_weights(self, weights: torch.Tensor) -> None:
        """Record the next layer's norm weights (Megatron-Core's fused-path hook; unused here)."""
        self.next_layer_norm_weights = weights

    def _set_residual(self, residual: torch.Tensor) -> None:
        """Record the residual (Megatron-Core's fused-path hook; unused here)."""
        self.residual = residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``(output, bias)``: ``[s/TP, b, out]`` under TP; the parent's forward in training or under autograd."""
        if not _forward_only(self):
            return super().forward(x)
        if not self.input_is_parallel:
            raise ValueError("InferenceRowParallelLinear's inference path needs input_is_parallel=True")
        output = F.linear(x, self.weight)
        if self.tp_size > 1 and not self.explicit_expert_comm:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output if self.bias is None else output + self.bias.to(output.dtype)), None


def inference_all_gather_from_tensor_model_parallel_region(x: torch.Tensor, tp_group: Any, config: Any
                                                           ) -> torch.Tensor:
    """All-gather ``x``'s last dimension over ``tp_group`` (Megatron-Core's NVLS path falls back to this)."""
    if get_pg_size(tp_group) == 1:
        return x
    return gather_from_tensor_model_parallel_region(x, group=tp_group)


def inference_reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp_group: Any, config: Any
                                                          ) -> torch.Tensor:
    """Sum ``x`` over ``tp_group`` and keep this rank's slice of dim 0 (Megatron-Core's NVLS path falls back to
    this)."""
    if get_pg_size(tp_group) == 1:
        return x
    return reduce_scatter_to_sequence_parallel_region(x, group=tp_group)
