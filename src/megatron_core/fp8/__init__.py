"""FP8 training without Transformer Engine: float8 GEMMs in the tensor-parallel linear layers and the
MoE experts' grouped GEMMs.

``convert_to_float8(model)`` after building a model whose config sets ``fp8`` (and ``fp8_recipe``
``'delayed'``, Megatron-Core's default, or ``'tensorwise'`` / ``'rowwise'``); see
:mod:`megatron_core.fp8.layers`, :mod:`megatron_core.fp8.delayed_linear` (delayed scaling, our own op)
and :mod:`megatron_core.fp8.grouped_layers`. torchao is imported only when a model is converted with a
torchao recipe (and, for the experts, when their FP8 grouped GEMM first runs on a GPU). With ``fp8_param``
(``'tensorwise'``) the converted weights are stored in FP8 (:mod:`megatron_core.distributed.fp8_params`, GEMM
:mod:`megatron_core.fp8.fp8_param_linear`; the experts' with row-wise scales, GEMM
:mod:`megatron_core.fp8.fp8_param_grouped`), updated by the distributed optimizer.
"""

from megatron_core.fp8.delayed_linear import DelayedFloat8Matmul, delayed_float8_matmul
from megatron_core.fp8.delayed_scaling import DelayedScalingRecipe
from megatron_core.fp8.grouped_gemm import fp8_grouped_gemm
from megatron_core.fp8.grouped_layers import Float8ColumnParallelGroupedLinear, Float8RowParallelGroupedLinear
from megatron_core.fp8.layers import Float8ColumnParallelLinear, Float8RowParallelLinear, convert_to_float8
from megatron_core.fp8.torchao_backend import check_fp8_config, check_fp8_device, float8_linear_config

__all__ = [
    "DelayedFloat8Matmul",
    "DelayedScalingRecipe",
    "Float8ColumnParallelGroupedLinear",
    "Float8ColumnParallelLinear",
    "Float8RowParallelGroupedLinear",
    "Float8RowParallelLinear",
    "check_fp8_config",
    "check_fp8_device",
    "convert_to_float8",
    "delayed_float8_matmul",
    "float8_linear_config",
    "fp8_grouped_gemm",
]
