"""FP8 versions of the MoE experts' grouped linear layers (made by :func:`megatron_core.fp8.convert_to_float8`).

:class:`Float8ColumnParallelGroupedLinear` and :class:`Float8RowParallelGroupedLinear` keep their parents'
parameters, state-dict keys (``weight0 ..``) and expert-parallel layout; only the grouped GEMM changes to
:func:`megatron_core.fp8.grouped_gemm.fp8_grouped_gemm` (e4m3, row-wise scales, whatever ``fp8_recipe``
the dense layers use: it is the one FP8 grouped recipe the Hopper kernel has). On a GPU each expert's
rows must start at a multiple of 16: the aligned layout of the experts provides that, and host-known
counts are padded here. On a CPU, or with ``float8_emulate``, the GEMM is emulated in fp32. ``float8_wgrad``
(set from ``config.fp8_wgrad`` by the conversion) False computes the weight gradient in high precision.

With ``fp8_param`` (:func:`megatron_core.fp8.convert_to_float8`) the weight is an FP8 parameter with row-wise scales
(:mod:`megatron_core.distributed.fp8_params`) and the GEMM is
:func:`megatron_core.fp8.fp8_param_grouped.fp8_param_grouped_gemm` (the stored codes, no cast of the weight). The
layer then keeps its bytes through ``.to()`` / ``Float16Module``, saves each expert's dequantized weight under
``weight{e}`` and re-quantizes what it loads.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.distributed.fp8_params import (
    copy_tensor_to_quantized_param,
    dequantize_fp8_tensor,
    is_fp8_param,
)
from megatron_core.fp8.expert_gemm_mode import per_expert_host_ends
from megatron_core.fp8.fp8_param_grouped import fp8_param_grouped_gemm
from megatron_core.fp8.fp8_param_module import apply_keeping_fp8_params
from megatron_core.fp8.grouped_gemm import ROW_ALIGN, fp8_grouped_gemm
from megatron_core.fp8.grouped_swiglu import fp8_grouped_gemm_weighted_swiglu, fused_weighted_swiglu_serves
from megatron_core.fp8.grouped_weight_cache import (
    allocate_grouped_weight_caches,
    cached_grouped_weight_operands,
)
from megatron_core.transformer.moe.grouped_linear import (
    ColumnParallelGroupedLinear,
    RowParallelGroupedLinear,
    pad_expert_rows,
    unpad_expert_rows,
)
from megatron_core.transformer.moe.host_counts import counts_to_host
from megatron_core.transformer.moe.token_permutation import AlignedRows


def _fp8_gemm(layer: torch.nn.Module, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> torch.Tensor:
    emulate = layer.float8_emulate or x.device.type != "cuda"
    cached = cached_grouped_weight_operands(layer)
    if is_fp8_param(layer.weight):
        gemm, options = fp8_param_grouped_gemm, dict(weight_t=cached)
    else:
        gemm, options = fp8_grouped_gemm, dict(weight_codes=cached)
    options["fp8_wgrad"] = bool(layer.float8_wgrad)
    if isinstance(tokens_per_expert, AlignedRows):
        if not emulate:
            return gemm(x, layer.weight, ends=tokens_per_expert.ends, host_ends=tokens_per_expert.host_ends, **options)
        tokens_per_expert = counts_to_host(tokens_per_expert.counts, "the FP8 experts' emulated GEMM")
    counts = list(tokens_per_expert)
    if emulate:
        return gemm(x, layer.weight, counts=counts, emulate=True, **options)
    if all(c % ROW_ALIGN == 0 for c in counts):
        return gemm(x, layer.weight, counts=counts, **options)
    padded_x, padded, index = pad_expert_rows(x, counts)
    return unpad_expert_rows(gemm(padded_x, layer.weight, counts=padded, **options), index)


class _Fp8ParamGroupedMixin:
    """Module behaviour of a grouped layer whose weight may be an FP8 parameter (``fp8_param``), and its FP8 weight
    operands cached across a step's micro-batches (:mod:`megatron_core.fp8.grouped_weight_cache`)."""

    # Transformer Engine's flag: True before a step's first micro-batch (``set_is_first_microbatch``), when the cached
    # FP8 weight operands are refreshed; None while no schedule says where steps begin (no cache used).
    is_first_microbatch: bool | None = None

    def allocate_weight_caches(self) -> None:
        """Give the weight its FP8 operand cache (see :mod:`megatron_core.fp8.grouped_weight_cache`)."""
        allocate_grouped_weight_caches(self)

    def rows_for_gemms(self, tokens_per_expert: list[int] | AlignedRows) -> list[int] | AlignedRows:
        """The group layout for this layer's GEMMs and the expert MLP's others: in the ``per_expert`` and
        ``per_expert_backward`` GEMM modes (:mod:`megatron_core.fp8.expert_gemm_mode`) an ``AlignedRows`` carrying the
        host copy of its group ends, made here once for fc1 and fc2, forward and backward; otherwise (emulated GEMMs
        included) ``tokens_per_expert``."""
        if (not isinstance(tokens_per_expert, AlignedRows) or tokens_per_expert.host_ends is not None
                or self.float8_emulate):
            return tokens_per_expert
        host_ends = per_expert_host_ends(tokens_per_expert.ends)
        return tokens_per_expert if host_ends is None else tokens_per_expert.with_host_ends(host_ends)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """The parent's ``_apply``, an FP8 weight keeping its bytes (see ``apply_keeping_fp8_params``)."""
        return apply_keeping_fp8_params(self, super()._apply, fn, recurse)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The parent's ``weight{e}`` entries, from the dequantized weight when it is an FP8 parameter."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if is_fp8_param(self.weight):
            value = dequantize_fp8_tensor(self.weight)
            for e in range(self.num_gemms):
                destination[f"{prefix}weight{e}"] = value[e]

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """The parent's load; an FP8 weight is loaded into its dequantized value and re-quantized from it."""
        weight = self._parameters.get("weight")
        if not is_fp8_param(weight):
            super()._load_from_state_dict(state_dict, prefix, *args)
            self._refresh_caches_after_load()
            return
        staging = torch.nn.Parameter(dequantize_fp8_tensor(weight), requires_grad=False)
        self._parameters["weight"] = staging
        try:
            super()._load_from_state_dict(state_dict, prefix, *args)
        finally:
            self._parameters["weight"] = weight
        copy_tensor_to_quantized_param(weight, staging.detach())
        self._refresh_caches_after_load()

    def _refresh_caches_after_load(self) -> None:
        if self.is_first_microbatch is False:
            self.is_first_microbatch = True  # the cached operands hold the old weight: refresh them


class Float8ColumnParallelGroupedLinear(_Fp8ParamGroupedMixin, ColumnParallelGroupedLinear):
    """``ColumnParallelGroupedLinear`` (experts' fc1) whose grouped GEMM runs in FP8."""

    float8_emulate: bool = False
    float8_wgrad: bool = True  # config.fp8_wgrad: False computes the weight gradient in high precision

    def gemm(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> torch.Tensor:
        """``cat_e(x_e @ weight[e].T)`` in FP8."""
        return _fp8_gemm(self, x, tokens_per_expert)

    def fuses_weighted_swiglu(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> bool:
        """Whether :meth:`forward` can apply the weighted SwiGLU to its output in one function with the GEMM
        (:mod:`megatron_core.fp8.grouped_swiglu`): a high-precision weight on Hopper, rows laid out by the dispatcher
        (``AlignedRows``), no bias, no deferred weight gradient, not emulated."""
        return (isinstance(tokens_per_expert, AlignedRows) and self.bias is None and not self.float8_emulate
                and not is_fp8_param(self.weight) and not self.delay_wgrad_compute
                and fused_weighted_swiglu_serves(x, self.weight))

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows,
                weighted_swiglu_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The parent's ``(output, bias)``; with ``weighted_swiglu_probs [rows, 1]`` (where
        :meth:`fuses_weighted_swiglu`) ``(weighted_swiglu(output, probs), None)`` from one function."""
        if weighted_swiglu_probs is None:
            return super().forward(x, tokens_per_expert)
        if not self.fuses_weighted_swiglu(x, tokens_per_expert):
            raise ValueError("weighted_swiglu_probs: this layer cannot fuse the weighted SwiGLU here (it needs a "
                             "high-precision weight on Hopper, AlignedRows, no bias, no deferred weight gradient; "
                             "fuses_weighted_swiglu says when)")
        output = fp8_grouped_gemm_weighted_swiglu(x, self.weight, tokens_per_expert.ends, weighted_swiglu_probs,
                                                  fp8_wgrad=bool(self.float8_wgrad),
                                                  weight_codes=cached_grouped_weight_operands(self),
                                                  host_ends=tokens_per_expert.host_ends)
        return output, None


class Float8RowParallelGroupedLinear(_Fp8ParamGroupedMixin, RowParallelGroupedLinear):
    """``RowParallelGroupedLinear`` (experts' fc2) whose grouped GEMM runs in FP8."""

    float8_emulate: bool = False
    float8_wgrad: bool = True  # config.fp8_wgrad: False computes the weight gradient in high precision

    def gemm(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> torch.Tensor:
        """``cat_e(x_e @ weight[e].T)`` in FP8."""
        return _fp8_gemm(self, x, tokens_per_expert)


GROUPED_FP8_CLASSES = {ColumnParallelGroupedLinear: Float8ColumnParallelGroupedLinear,
                       RowParallelGroupedLinear: Float8RowParallelGroupedLinear}
