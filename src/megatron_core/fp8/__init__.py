"""FP8 training without Transformer Engine: torchao float8 GEMMs in the tensor-parallel linear layers.

``convert_to_float8(model)`` after building a model whose config sets ``fp8`` (and
``fp8_recipe='tensorwise'`` or ``'rowwise'``); see :mod:`megatron_core.fp8.layers`. torchao is
imported only when a model is converted.
"""

from megatron_core.fp8.layers import Float8ColumnParallelLinear, Float8RowParallelLinear, convert_to_float8
from megatron_core.fp8.torchao_backend import check_fp8_config, check_fp8_device, float8_linear_config

__all__ = [
    "Float8ColumnParallelLinear",
    "Float8RowParallelLinear",
    "check_fp8_config",
    "check_fp8_device",
    "convert_to_float8",
    "float8_linear_config",
]
