"""The MoE experts' FP8 weight operands cached across a step's micro-batches (``is_first_microbatch``).

As Transformer Engine's FP8 ``GroupedLinear`` caches its weights: between the micro-batches of one step the weights
do not change, so the FP8 operands made from them are made once, in the step's first forward, and read by the other
micro-batches' forward and backward passes. The schedules mark a step's start with the model's
``set_is_first_microbatch`` (:class:`megatron_core.transformer.module.MegatronModule`), which sets
``is_first_microbatch = True`` on every layer that has the flag and calls its ``allocate_weight_caches``.

* A high-precision expert weight ``[E, out, in]`` (cast in every forward without the cache): its e4m3 codes, their
  dequantizing scales ``[E, out]`` and the codes transposed ``[E, in, out]`` (the data gradient's operand), kept on
  the layer (``fp8_weight_codes``);
* an FP8 expert parameter (``fp8_param``; codes stored, written by the optimizer once per step): its codes
  transposed, kept on the parameter (``weight.fp8_transpose``, as the dense FP8 parameters keep theirs).

A layer whose flag is None (no schedule says where steps begin) keeps no cache and casts / transposes in every
pass, as before. The caches are buffers at static addresses (refreshed in place, as compiled CUDA graphs need) and
are not part of the state dict; a checkpoint load forces the next refresh, and a cache on another device than the
weight is ignored until the next step's start reallocates it. The contract is Transformer Engine's: between two
``set_is_first_microbatch`` calls the weights must not change (an optimizer step comes after a step's last
micro-batch).
"""

from __future__ import annotations

import torch

from megatron_core.distributed.fp8_params import is_fp8_param
from megatron_core.fp8.cast_kernels import fp8_cast_kernels_available, rowwise_cast_into, transpose_codes_into
from megatron_core.fp8.scaled_grouped_mm import E4M3, quantize_weight_rowwise, transposed_weight_codes

__all__ = ["allocate_grouped_weight_caches", "cached_grouped_weight_operands"]

WeightCodes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _static(t: torch.Tensor) -> torch.Tensor:
    torch._dynamo.mark_static_address(t, guard=False)
    return t


def _fits(cache: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> bool:
    return cache is not None and tuple(cache.shape) == tuple(shape) and cache.device == device


def allocate_grouped_weight_caches(layer: torch.nn.Module) -> None:
    """Give the grouped layer's weight ``[E, out, in]`` its cache (see the module docstring), unless one of the right
    shape on the weight's device exists."""
    weight = layer.weight
    experts, out_features, _ = weight.shape
    transposed_shape = weight.transpose(-2, -1).shape
    if is_fp8_param(weight):
        if not _fits(getattr(weight, "fp8_transpose", None), transposed_shape, weight.device):
            weight.fp8_transpose = _static(torch.empty(transposed_shape, dtype=weight.dtype, device=weight.device))
        return
    cached = getattr(layer, "fp8_weight_codes", None)
    if cached is None or not _fits(cached[0], weight.shape, weight.device):
        layer.fp8_weight_codes = (
            _static(torch.empty(weight.shape, dtype=E4M3, device=weight.device)),
            _static(torch.empty(experts, out_features, dtype=torch.float32, device=weight.device)),
            _static(torch.empty(transposed_shape, dtype=E4M3, device=weight.device)),
        )


@torch.library.custom_op("megatron_core::fp8_refresh_grouped_weight_codes_", mutates_args=("codes", "scales", "codes_t"))
def _refresh_weight_codes(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                          codes_t: torch.Tensor) -> None:
    """``weight [E, out, in]``'s row-wise e4m3 codes, dequantizing scales and transposed codes written into the
    cache's buffers: on CUDA by the Triton kernels straight into them (opaque to ``torch.compile``, which would
    otherwise copy each result into its buffer: three more passes over the codes), elsewhere by the formulas."""
    if fp8_cast_kernels_available(weight):
        rowwise_cast_into(weight.view(-1, weight.shape[-1]), codes.view(-1, weight.shape[-1]), scales.view(-1))
        transpose_codes_into(codes, codes_t)
        return
    new_codes, new_scales = quantize_weight_rowwise(weight)
    codes.copy_(new_codes)
    scales.copy_(new_scales)
    codes_t.copy_(transposed_weight_codes(new_codes))


@_refresh_weight_codes.register_fake
def _(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codes_t: torch.Tensor) -> None:
    return None


@torch.library.custom_op("megatron_core::fp8_refresh_transposed_codes_", mutates_args=("codes_t",))
def _refresh_transposed_codes(codes: torch.Tensor, codes_t: torch.Tensor) -> None:
    """The e4m3 ``codes [E, out, in]`` transposed into ``codes_t [E, in, out]`` (the FP8 parameter's cache)."""
    if fp8_cast_kernels_available(codes) and codes_t.is_contiguous():
        transpose_codes_into(codes, codes_t)
        return
    codes_t.copy_(transposed_weight_codes(codes))


@_refresh_transposed_codes.register_fake
def _(codes: torch.Tensor, codes_t: torch.Tensor) -> None:
    return None


def _refresh(weight: torch.Tensor, cache: WeightCodes | torch.Tensor) -> None:
    with torch.no_grad():
        if is_fp8_param(weight):
            _refresh_transposed_codes(weight.detach(), cache)
            return
        _refresh_weight_codes(weight.detach().contiguous(), *cache)


def cached_grouped_weight_operands(layer: torch.nn.Module) -> WeightCodes | torch.Tensor | None:
    """The layer's cached FP8 weight operands for this micro-batch: ``(codes, scales, transposed codes)`` of a
    high-precision weight, or the transposed codes of an FP8 parameter; refreshed (and the flag set False) when
    ``layer.is_first_microbatch`` is True, reused while it is False; None when the flag is None or the layer has no
    cache on its weight's device."""
    first = getattr(layer, "is_first_microbatch", None)
    if first is None:
        return None
    weight = layer.weight
    if is_fp8_param(weight):
        cache = getattr(weight, "fp8_transpose", None)
        usable = _fits(cache, weight.transpose(-2, -1).shape, weight.device)
    else:
        cache = getattr(layer, "fp8_weight_codes", None)
        usable = cache is not None and _fits(cache[0], weight.shape, weight.device)
    if not usable:
        return None
    if first:
        _refresh(weight, cache)
        layer.is_first_microbatch = False
    return cache
