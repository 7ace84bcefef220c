"""Layers of the Model Optimizer layer spec (Megatron-Core's ``post_training.modelopt.layers``).

* :class:`Norm` builds the layer's LayerNorm or RMSNorm. Megatron-Core builds Transformer Engine's
  norm here; without Transformer Engine this library builds its own
  (:mod:`megatron_core.fusions.norms`), with the same parameter names.
* :class:`Linear` is a duplicated (not tensor-parallel) ``torch.nn.Linear`` with the parallel
  layers' ``(output, bias)`` interface, for projections every TP rank computes whole (MLA's down
  projections).
* :class:`RealQuantTransformerLayer` and its FP8 subclasses quantize their own linear weights for
  real (weight-only, stored in FP8) right after they are built, through Model Optimizer's
  ``quantize`` + ``compress``; their parameters are frozen.

Model Optimizer itself is only imported by :class:`RealQuantTransformerLayer` (through
``_backend``); the other two are plain PyTorch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core.fusions.norms import LayerNorm, RMSNorm
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayer

__all__ = [
    "FP8_2D_BLOCKWISE_REAL_QUANT_CFG",
    "FP8_PER_TENSOR_REAL_QUANT_CFG",
    "BlockwiseFP8WeightTransformerLayer",
    "FP8WeightTransformerLayer",
    "Linear",
    "Norm",
    "RealQuantTransformerLayer",
]

logger = logging.getLogger(__name__)

# Weight-only FP8 (E4M3) with one scale per tensor; activations and the output layer stay unquantized. Model
# Optimizer applies the patterns in order (a later match overrides), so "default" (everything off) comes first.
FP8_PER_TENSOR_REAL_QUANT_CFG: dict[str, Any] = {
    "quant_cfg": {
        "default": {"enable": False},
        "*weight_quantizer": {"num_bits": (4, 3), "axis": None},
        "*input_quantizer": {"enable": False},
        "*output_layer*": {"enable": False},
    },
    "algorithm": "max",
}

# Weight-only FP8 (E4M3) with one scale per 128 x 128 block (DeepSeek-V3's weight format).
FP8_2D_BLOCKWISE_REAL_QUANT_CFG: dict[str, Any] = {
    "quant_cfg": {
        "default": {"enable": False},
        "*weight_quantizer": {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}},
        "*input_quantizer": {"enable": False},
        "*output_layer*": {"enable": False},
    },
    "algorithm": "max",
}

_REAL_QUANT_CFGS = {
    "fp8_real_quant": FP8_PER_TENSOR_REAL_QUANT_CFG,
    "fp8_blockwise_real_quant": FP8_2D_BLOCKWISE_REAL_QUANT_CFG,
}


class Norm:
    """Builds the LayerNorm or RMSNorm that ``config.normalization`` names (Transformer Engine's role in Megatron)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            return LayerNorm(config, hidden_size, eps)
        if config.normalization == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        raise ValueError(f"config.normalization ({config.normalization!r}) must be 'LayerNorm' or 'RMSNorm'")


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with a parallel linear's constructor and ``(output, bias)`` result, never split over TP.

    ``parallel_mode`` is ``None`` or ``"duplicated"`` (every TP rank holds the whole weight; then no
    ``tp_group`` may be given). Arguments the parallel layers use for their own communication and
    weight layouts (``stride``, ``skip_weight_param_allocation``, the activation and gradient
    buffers) have no meaning here and must keep their defaults.
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer: list | None = None,
                 grad_output_buffer: list | None = None, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, disable_grad_reduce: bool = False,
                 parallel_mode: str | None = None, tp_group: Any = None, name: str | None = None) -> None:
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"Linear: parallel_mode ({parallel_mode!r}) must be None or 'duplicated'")
        if parallel_mode == "duplicated" and tp_group is not None:
            raise ValueError("Linear: a parallel_mode='duplicated' layer takes no tp_group")
        unsupported = {
            "stride": (stride, 1), "skip_weight_param_allocation": (skip_weight_param_allocation, False),
            "embedding_activation_buffer": (embedding_activation_buffer, None),
            "grad_output_buffer": (grad_output_buffer, None),
        }
        for field, (value, default) in unsupported.items():
            if value != default:
                raise ValueError(f"Linear: {field} ({value!r}) is not supported; it must be {default!r}")
        super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)
        self.config = config
        self.parallel_mode = parallel_mode
        self.tp_group = None if parallel_mode == "duplicated" else tp_group
        self.is_expert = is_expert
        self._return_bias = skip_bias_add and bias
        if config.perform_initialization:
            init_method(self.weight)
            if bias:
                with torch.no_grad():
                    self.bias.zero_()
        tp_size = config.tensor_model_parallel_size
        # An expert's gradients are reduced by the MoE layer's own groups once experts are parallelised.
        expert_groups = is_expert and (config.expert_model_parallel_size > 1
                                       or (config.expert_tensor_parallel_size or tp_size) != tp_size)
        for param in self.parameters():
            param.allreduce = not expert_groups
            param.sequence_parallel = config.sequence_parallel and not is_expert
            param.tensor_model_parallel = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x W^T + b, None)``, or ``(x W^T, b)`` with ``skip_bias_add``."""
        if self._return_bias:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return super().forward(x), None


class RealQuantTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose linear weights are quantized for real as soon as it is built.

    Subclasses name a weight-only recipe in ``real_quant_cfg`` (see ``_REAL_QUANT_CFGS``); the layer
    runs Model Optimizer's ``quantize`` (max calibration of the weights alone) and ``compress``, which
    replaces each weight by its low-precision copy plus scales. The layer cannot be trained: every
    parameter is frozen. ``verbose`` logs each tensor's dtype and shape before and after.
    """

    verbose: bool = False
    real_quant_cfg: str = "None"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.real_quant_cfg == "None":
            return
        if self.real_quant_cfg not in _REAL_QUANT_CFGS:
            raise ValueError(f"real_quant_cfg ({self.real_quant_cfg!r}) must be one of {sorted(_REAL_QUANT_CFGS)}")
        mo = modelopt_modules("a real-quantized transformer layer")
        if tensor_parallel.ColumnParallelLinear not in mo.nn.QuantModuleRegistry:
            raise ValueError(f"{type(self).__name__} quantizes this library's linear layers, which are not registered "
                             "with Model Optimizer: call megatron_core.post_training.modelopt.register_quant_modules() "
                             "first (get_gpt_modelopt_spec does)")
        mtq = mo.mtq
        before = self._tensor_info()
        mtq.quantize(self, _REAL_QUANT_CFGS[self.real_quant_cfg])
        mtq.compress(self)
        # The layer keeps its quantized weights; the record of the conversion belongs to a whole model.
        if hasattr(self, "_modelopt_state"):
            delattr(self, "_modelopt_state")
        for param in self.parameters():
            param.requires_grad = False
        if self.verbose:
            after = self._tensor_info()
            for key, (dtype, shape) in after.items():
                old_dtype, old_shape = before.get(key, ("-", "-"))
                logger.info("%-64s %-16s %-32s %-16s %-32s", key, old_dtype, old_shape, dtype, shape)

    def _tensor_info(self) -> dict[str, tuple[str, str]]:
        return {k: (str(v.dtype), str(tuple(v.shape))) for k, v in self.state_dict().items()
                if isinstance(v, torch.Tensor)}


class FP8WeightTransformerLayer(RealQuantTransformerLayer):
    """Linear weights stored in FP8 (E4M3) with one scale per tensor."""

    real_quant_cfg: str = "fp8_real_quant"


class BlockwiseFP8WeightTransformerLayer(RealQuantTransformerLayer):
    """Linear weights stored in FP8 (E4M3) with one scale per 128 x 128 block."""

    real_quant_cfg: str = "fp8_blockwise_real_quant"
