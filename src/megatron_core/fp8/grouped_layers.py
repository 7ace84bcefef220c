"""FP8 versions of the MoE experts' grouped linear layers (made by :func:`megatron_core.fp8.convert_to_float8`).

:class:`Float8ColumnParallelGroupedLinear` and :class:`Float8RowParallelGroupedLinear` keep their parents'
parameters, state-dict keys (``weight0 ..``) and expert-parallel layout; only the grouped GEMM changes to
:func:`megatron_core.fp8.grouped_gemm.fp8_grouped_gemm` (e4m3, row-wise scales, whatever ``fp8_recipe``
the dense layers use: it is the one FP8 grouped recipe the Hopper kernel has). On a GPU each expert's
rows must start at a multiple of 16: the aligned layout of the experts provides that, and host-known
counts are padded here. On a CPU, or with ``float8_emulate``, the GEMM is emulated in fp32.
"""

from __future__ import annotations

import torch

from megatron_core.fp8.grouped_gemm import ROW_ALIGN, fp8_grouped_gemm
from megatron_core.transformer.moe.grouped_linear import (
    ColumnParallelGroupedLinear,
    RowParallelGroupedLinear,
    pad_expert_rows,
    unpad_expert_rows,
)
from megatron_core.transformer.moe.token_permutation import AlignedRows


def _fp8_gemm(layer: torch.nn.Module, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> torch.Tensor:
    emulate = layer.float8_emulate or x.device.type != "cuda"
    if isinstance(tokens_per_expert, AlignedRows):
        if not emulate:
            return fp8_grouped_gemm(x, layer.weight, ends=tokens_per_expert.ends)
        tokens_per_expert = tokens_per_expert.counts.tolist()
    counts = list(tokens_per_expert)
    if emulate:
        return fp8_grouped_gemm(x, layer.weight, counts=counts, emulate=True)
    if all(c % ROW_ALIGN == 0 for c in counts):
        return fp8_grouped_gemm(x, layer.weight, counts=counts)
    padded_x, padded, index = pad_expert_rows(x, counts)
    return unpad_expert_rows(fp8_grouped_gemm(padded_x, layer.weight, counts=padded), index)


class Float8ColumnParallelGroupedLinear(ColumnParallelGroupedLinear):
    """``ColumnParallelGroupedLinear`` (experts' fc1) whose grouped GEMM runs in FP8."""

    float8_emulate: bool = False

    def gemm(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> torch.Tensor:
        """``cat_e(x_e @ weight[e].T)`` in FP8."""
        return _fp8_gemm(self, x, tokens_per_expert)


class Float8RowParallelGroupedLinear(RowParallelGroupedLinear):
    """``RowParallelGroupedLinear`` (experts' fc2) whose grouped GEMM runs in FP8."""

    float8_emulate: bool = False

    def gemm(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> torch.Tensor:
        """``cat_e(x_e @ weight[e].T)`` in FP8."""
        return _fp8_gemm(self, x, tokens_per_expert)


GROUPED_FP8_CLASSES = {ColumnParallelGroupedLinear: Float8ColumnParallelGroupedLinear,
                       RowParallelGroupedLinear: Float8RowParallelGroupedLinear}
