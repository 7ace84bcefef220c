"""The per-recipe rules of the quantized Hugging Face export (Model Optimizer's unified format).

:mod:`.hf_export` gathers, for every quantized linear of the model, its quantizers' values (weight amax,
input amax, pre-quantization scale) split to the Hugging Face tensors the bridge writes (q/k/v, gate/up,
TP shards joined: :func:`linear_quant_info` on each rank, :func:`hf_quant_info` on rank 0); this module
turns one such HF weight, already fake-quantized, into the tensors Model Optimizer's ``export_hf_checkpoint``
writes for the recipe (:func:`quantized_tensors`), with Model Optimizer's own packing and scale helpers:

* ``FP8_DEFAULT_CFG`` (``FP8``): E4M3 weight, scalar ``weight_scale`` = amax / 448, scalar ``input_scale``;
* ``INT8_SMOOTHQUANT_CFG`` (``W8A8_SQ_PER_CHANNEL``): int8 weight, ``weight_scale`` = amax / 127 per output
  channel, scalar ``input_scale``, and the SmoothQuant scale as ``pre_quant_scale`` on every projection;
* ``INT4_AWQ_CFG`` (``W4A16_AWQ``): int4 codes packed two output rows per ``uint8``, ``weight_scale`` = amax / 7
  per 128-wide input block; the AWQ scale of projections that share their input with others (q/k/v after the
  input norm, gate/up after the MLP norm) folded into that norm's weight, as Model Optimizer does when it fuses
  them, and written as ``pre_quant_scale`` for the rest (o_proj, down_proj);
* ``NVFP4_DEFAULT_CFG`` (``NVFP4``): E2M1 codes packed two per ``uint8``, E4M3 ``weight_scale`` per 16-wide
  block, ``weight_scale_2`` = amax / (6 * 448), ``input_scale`` = input amax / (6 * 448).

Fused Megatron weights have one quantizer, so their HF parts share the per-tensor scales, as Model
Optimizer's export makes fused HF projections share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_core.post_training.modelopt._backend import modelopt_export_helpers

__all__ = ["EXPORT_FORMATS", "ExportFormat", "HFQuantInfo", "LinearQuantInfo", "hf_quant_info",
           "linear_quant_info", "quantized_tensors"]

_E4M3_MAX = 448.0


@dataclass(frozen=True)
class ExportFormat:
    """How one recipe is exported: Model Optimizer's ``quant_algo``, export format name and config fields."""

    quant_algo: str
    modelopt_format: str
    config: dict = field(default_factory=dict)
    block_size: int | None = None
    fold_pre_quant_scale: bool = False


# recipe -> its export format (hf_quant_config.json's "quantization" fields besides quant_algo / exclusions)
EXPORT_FORMATS = {
    "FP8_DEFAULT_CFG": ExportFormat("FP8", "fp8"),
    "INT8_SMOOTHQUANT_CFG": ExportFormat("W8A8_SQ_PER_CHANNEL", "int8_sq"),
    "INT4_AWQ_CFG": ExportFormat("W4A16_AWQ", "int4_awq",
                                 {"group_size": 128, "has_zero_point": False, "pre_quant_scale": True}, 128, True),
    "NVFP4_DEFAULT_CFG": ExportFormat("NVFP4", "nvfp4", {"group_size": 16}, 16),
}


@dataclass
class LinearQuantInfo:
    """One rank's quantizer values of one quantized linear (picklable, gathered to rank 0).

    ``layout`` is how its TP shards split: ``"column"`` (output rows), ``"row"`` (input columns) or
    ``"none"`` (duplicated). ``weight_amax`` is a scalar or ``[local rows, columns]``: per input block
(``blocked``, split like the weight) or per output channel (one column, replicated on a row layer).
    """

    rule: Any
    layer: Any
    tp_rank: int
    layout: str
    weight_amax: torch.Tensor
    weight_maxbound: float
    input_amax: torch.Tensor | None
    input_maxbound: float
    pre_quant_scale: torch.Tensor | None
    norm: tuple[str, ...] = ()
    blocked: bool = False


@dataclass
class HFQuantInfo:
    """The quantizer values of one HF weight: scalar or ``[rows, columns]`` weight amax, the rest shared.

    ``fold_into`` names the norm tensors the pre-quantization scale is folded into (then not written beside
    the weight).
    """

    weight_amax: torch.Tensor
    weight_maxbound: float
    input_amax: torch.Tensor | None
    input_maxbound: float
    pre_quant_scale: torch.Tensor | None
    fold_into: tuple[str, ...] = ()


def _amax(quantizer: Any) -> torch.Tensor | None:
    if not quantizer.is_enabled or quantizer.amax is None:
        return None
    return quantizer.export_amax().detach().float().cpu()


def linear_quant_info(module: torch.nn.Module, name: str, rule: Any, layer: Any, tp_rank: int, layout: str,
                      norm: tuple[str, ...]) -> LinearQuantInfo:
    """This rank's :class:`LinearQuantInfo` of the quantized linear ``module`` (``name`` for errors)."""
    weight_amax = _amax(module.weight_quantizer)
    if weight_amax is None:
        raise ValueError(f"{name}.weight_quantizer has no amax: calibrate the model before exporting it")
    if weight_amax.numel() > 1:
        weight_amax = weight_amax.reshape(module.weight.shape[0], -1)
    else:
        weight_amax = weight_amax.reshape(())
    input_quantizer = module.input_quantizer
    pre_quant_scale = getattr(input_quantizer, "pre_quant_scale", None)
    input_amax = _amax(input_quantizer)
    return LinearQuantInfo(
        rule, layer, tp_rank, layout, weight_amax, float(module.weight_quantizer.maxbound),
        None if input_amax is None else input_amax.reshape(()), float(input_quantizer.maxbound),
        None if pre_quant_scale is None else pre_quant_scale.detach().float().cpu().reshape(-1), norm,
        module.weight_quantizer.block_sizes is not None)


def hf_quant_info(shards: list[LinearQuantInfo], fmt: ExportFormat) -> dict[str, HFQuantInfo]:
    """``{HF weight name: HFQuantInfo}`` of one Megatron linear from its TP shards' infos (any order)."""
    shards = sorted(shards, key=lambda s: s.tp_rank)
    first = shards[0]
    hf_names = first.rule.hf_names(first.layer)
    if first.weight_amax.ndim == 0:
        amax = dict.fromkeys(hf_names, first.weight_amax)
    else:
        parts = shards if first.layout == "column" or (first.layout == "row" and first.blocked) else shards[:1]
        amax = first.rule.to_hf([s.weight_amax for s in parts], first.layer)
    pre_quant_scale = first.pre_quant_scale
    if pre_quant_scale is not None and first.layout == "row":
        pre_quant_scale = torch.cat([s.pre_quant_scale for s in shards])
    # Model Optimizer folds an AWQ scale into the norm only for projections fused with others on one input
    fold = first.norm if fmt.fold_pre_quant_scale and len(hf_names) > 1 and pre_quant_scale is not None else ()
    return {name: HFQuantInfo(amax[name], first.weight_maxbound, first.input_amax, first.input_maxbound,
                              pre_quant_scale, fold) for name in hf_names}


def quantized_tensors(fmt: ExportFormat, stem: str, weight: torch.Tensor, info: HFQuantInfo
                      ) -> dict[str, torch.Tensor]:
    """The tensors Model Optimizer's unified export writes for the HF weight ``<stem>.weight``.

    ``weight`` is the fake-quantized value (the bridge's export of it), so requantizing it reproduces
    the codes the model multiplies by.
    """
    helpers = modelopt_export_helpers()
    weight_scale_2 = None
    if fmt.modelopt_format == "nvfp4":
        weight_scale_2 = info.weight_amax.float() / (info.weight_maxbound * _E4M3_MAX)
        weight_scale = helpers.NVFP4QTensor.get_weights_scaling_factor(weight, fmt.block_size, weight_scale_2)[0]
        input_scale = None if info.input_amax is None else info.input_amax / (info.input_maxbound * _E4M3_MAX)
    else:
        weight_scale = info.weight_amax.float() / info.weight_maxbound
        if fmt.modelopt_format == "int8_sq":
            weight_scale = weight_scale.reshape(-1)
        input_scale = None if info.input_amax is None else info.input_amax / info.input_maxbound
    out = {f"{stem}.weight": helpers.quant_utils.to_quantized_weight(weight, weight_scale, fmt.modelopt_format,
                                                             weight_scale_2, fmt.block_size),
           f"{stem}.weight_scale": weight_scale.contiguous()}
    if weight_scale_2 is not None:
        out[f"{stem}.weight_scale_2"] = weight_scale_2.reshape(())
    if input_scale is not None:
        out[f"{stem}.input_scale"] = input_scale.float().reshape(())
    if info.pre_quant_scale is not None and not info.fold_into:
        out[f"{stem}.pre_quant_scale"] = info.pre_quant_scale.to(weight.dtype)
    return out
