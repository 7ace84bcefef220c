"""AWQ-lite's statistics of a parallel layer made those of the whole layer and all the data (TP=N, DP=N equal one process).

Model Optimizer's ``awq_lite`` searches, per linear layer, the exponent ``alpha`` of the per-input-channel
scales ``s = act_scale**alpha / weight_scale**(1 - alpha)`` that minimises the layer's output error. Under
Megatron-style parallelism each rank computes its inputs from its own part of the layer and of the data:

* tensor parallelism: a column-parallel layer (weight ``[out / TP, in]``, the input replicated over TP)
  computes ``weight_scale`` (the mean over the weight's rows of ``|w| / amax(|w| of its block)``, per input
  channel) and the output error of each ``alpha`` (the mean squared error of its output columns) from this
  rank's rows only, then each rank picks its own ``alpha`` and Model Optimizer averages the scales over TP.
  Averaging both statistics over TP first gives every rank the whole layer's (every rank holds as many
  rows and output columns, so the average of the per-rank means is the layer's mean); ``weight_scale`` is
  summed over all rows in the weight's dtype before its rounding to fp32, as one process rounds it.
  A row-parallel layer (weight ``[out, in / TP]``, the input split over TP, the output all-reduced) sees
  its own input channels' ``act_scale`` and, when its weight blocks fit whole in its input shard, their
  ``weight_scale``; its per-``alpha`` output errors are taken after the all-reduce, so every rank scores
  the whole layer. Two statistics are still this rank's: a weight quantizer without blocks divides each
  row by its amax over this rank's channels only (made the row's amax over all channels here), and Model
  Optimizer normalises the chosen scales by ``sqrt(max * min)`` of this rank's scales, not of the whole
  layer's. That constant cancels between the input's ``1 / s`` and the weight's ``s`` only up to fp32
  rounding, and it is what the layer stores (pre-quantization scale and weight amax, a few per cent from
  one process). So after Model Optimizer smooths the layer its weight is restored and smoothed again
  with the scales normalised by the whole layer's largest and smallest scale: one process's scales,
  amax and quantized weights. The search itself scores each ``alpha`` with this rank's normalisation:
  the same errors up to rounding, so the same ``alpha`` unless two ``alpha`` tie to rounding.
  Not equal to one process: INT4 blocks that straddle the input shards (``in / TP`` not a multiple of
  the block size) are quantized per shard, a different quantization than one process's (and refused by
  sharded checkpoints); and a row-parallel weight quantizer without input blocks (one amax per output
  row, e.g. a per-channel AWQ recipe): during the search each shard is quantized with its own rows'
  amax, so the errors and then ``alpha`` may differ (measured with per-channel INT4 at TP=2: two of four
  row layers chose another ``alpha``, scales 13 % apart; the layers that chose the same equal one
  process's). Model Optimizer's INT4 AWQ recipes have 128-wide blocks.
* data parallelism (the data-parallel group with context parallelism for dense layers, the expert
  data-parallel group for experts): each rank sees its own batches. Model Optimizer averages
  ``act_scale`` (the mean ``|x|`` per input channel) over the group but lets each rank score ``alpha`` on
  its own batches' errors. One process on the global batches (each step's batches of all ranks
  together) sees ``act_scale`` and errors that are the token-weighted means of the ranks': so each rank's
  ``act_scale`` is scaled by ``D * n_r / N`` before Model Optimizer's plain average (``n_r`` this rank's
  calibration tokens, ``N`` the group's, ``D`` its size; exactly 1 when all ranks saw as many tokens),
  and the per-``alpha`` errors are replaced by their token-weighted mean over the group. Then every rank
  picks the one-process ``alpha``. (Exact when each rank's batches have the same size at every step;
  with equal sizes that is also one process stepping through all the ranks' batches one by one.)

Model Optimizer gives a layer the chance through ``enable_weight_access_and_writeback``, a context it
enters on every rank in the same order: around creating a layer's AWQ state, around the weight pass of
``max_calibrate`` after the caching forward loop, and around choosing its scales. :func:`sync_awq_statistics`
runs at each entry and exit and acts once per stage; after choosing the scales it smooths a row-parallel
layer again (above).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.post_training.modelopt._backend import modelopt_modules

__all__ = ["sync_awq_statistics"]


def _group(group: Any) -> Any:
    """A Model Optimizer process group when it spans more than one rank, else ``None``."""
    if group is None or not group.is_initialized() or group.world_size() <= 1:
        return None
    return group


def _average_weight_scale_over_tp(layer: torch.nn.Module, helper: Any) -> None:
    """A column-parallel ``weight_scale``: the mean over all TP ranks' rows, summed in the weight's dtype."""
    group = _group(layer.parallel_state.tensor_parallel_group)
    if group is None or not getattr(layer, "_is_column_parallel", False) or not torch.is_tensor(helper.weight_scale):
        return
    weight = layer.weight.detach().abs()
    rows, cols = weight.shape
    size = helper.block_size or cols
    if cols % size:  # padded blocks: average Model Optimizer's per-rank means (in fp32)
        torch.distributed.all_reduce(helper.weight_scale, group=group.group)
        helper.weight_scale /= group.world_size()
        return
    blocks = weight.reshape(-1, size)
    normalised = (blocks / (blocks.amax(dim=1, keepdim=True) + torch.finfo(weight.dtype).tiny)).reshape(rows, cols)
    total = normalised.sum(0)
    torch.distributed.all_reduce(total, group=group.group)
    helper.weight_scale = (total / (rows * group.world_size())).to(torch.float32)


def _row_weight_scale_over_tp(layer: torch.nn.Module, helper: Any) -> None:
    """A row-parallel ``weight_scale`` without blocks: each row divided by its amax over all input channels."""
    group = _group(layer.parallel_state.tensor_parallel_group)
    if group is None or helper.block_size or not torch.is_tensor(helper.weight_scale):
        return
    weight = layer.weight.detach().abs()
    row_amax = weight.amax(dim=1, keepdim=True)
    torch.distributed.all_reduce(row_amax, op=torch.distributed.ReduceOp.MAX, group=group.group)
    helper.weight_scale = (weight / (row_amax + torch.finfo(weight.dtype).tiny)).mean(0).to(torch.float32)


def _layer_normalised_scale(layer: torch.nn.Module, helper: Any, group: Any) -> torch.Tensor:
    """AWQ-lite's scales of ``helper.best_alpha`` normalised by the whole layer's largest and smallest scale."""
    alpha = helper.best_alpha
    weight_scale = helper.weight_scale.to(helper.act_scale.device)
    raw = helper.act_scale.pow(alpha) / (weight_scale.pow(1 - alpha) + torch.finfo(torch.float32).tiny)
    raw = raw.clamp(min=1e-4, max=1e4).view(-1)
    largest, smallest = raw.max().reshape(1), raw.min().reshape(1)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=group.group)
    torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN, group=group.group)
    return raw / (largest * smallest).sqrt()


def _resmooth_row_layer(layer: torch.nn.Module, helper: Any) -> None:
    """Undo Model Optimizer's smoothing of a row-parallel layer and smooth it with the layer-normalised scales."""
    saved = getattr(helper, "_weight_before_smoothing", None)
    group = _group(layer.parallel_state.tensor_parallel_group)
    if saved is None or group is None or helper.best_alpha is None:
        return
    scale = _layer_normalised_scale(layer, helper, group)
    with torch.no_grad():
        layer.weight.copy_(saved)
    del helper._weight_before_smoothing
    for quantizer in (layer.input_quantizer, layer.weight_quantizer):
        if hasattr(quantizer, "_pre_quant_scale"):
            delattr(quantizer, "_pre_quant_scale")
    helper.best_scale = scale
    # inside the layer's own hook again (this stage is done, so it does nothing more), as Model Optimizer
    # smoothed it: an expert then re-calibrates its weight amax without the expert-parallel group
    with layer.enable_weight_access_and_writeback():
        modelopt_modules("AWQ calibration").calib.apply_pre_quant_scale_and_smooth(layer, 1.0 / scale)


def _dp_tokens(layer: torch.nn.Module, helper: Any) -> tuple[Any, float, float]:
    """``(data-parallel group or None, this rank's calibration tokens, the group's)``."""
    group = _group(layer.parallel_state.data_parallel_group)
    tokens = float(helper.num_tokens)
    if group is None:
        return None, tokens, tokens
    total = torch.tensor([tokens], dtype=torch.float64, device=layer.weight.device)
    torch.distributed.all_reduce(total, group=group.group)
    return group, tokens, float(total.item())


def _weight_act_scale_by_tokens(layer: torch.nn.Module, helper: Any) -> None:
    """Scale this rank's ``act_scale`` so that Model Optimizer's average over DP is the token-weighted mean."""
    group, tokens, total = _dp_tokens(layer, helper)
    helper._dp_tokens = (tokens, total)
    if group is not None and total > 0 and torch.is_tensor(helper.act_scale):
        helper.act_scale.mul_(group.world_size() * tokens / total)


def _combine_losses(layer: torch.nn.Module, helper: Any) -> None:
    """Per-``alpha`` errors: averaged over TP (column layers), then token-weighted mean over DP."""
    alphas = list(helper.loss)
    losses = torch.stack([torch.as_tensor(helper.loss[a], device=layer.weight.device).double() for a in alphas])
    tp = _group(layer.parallel_state.tensor_parallel_group)
    if tp is not None and getattr(layer, "_is_column_parallel", False):
        torch.distributed.all_reduce(losses, group=tp.group)
        losses /= tp.world_size()
    dp = _group(layer.parallel_state.data_parallel_group)
    tokens, total = helper._dp_tokens
    if dp is not None and total > 0:
        losses *= tokens
        torch.distributed.all_reduce(losses, group=dp.group)
        losses /= total
    helper.loss.update({a: losses[i] for i, a in enumerate(alphas)})


def _smoothed(layer: torch.nn.Module) -> bool:
    """Whether Model Optimizer has finished smoothing ``layer``: its scales are set and its weight amax taken.

    (Smoothing re-enters the layer's hook around its weight calibration, before the weight amax is loaded.)
    """
    return layer.input_quantizer.pre_quant_scale is not None and layer.weight_quantizer.amax is not None


def sync_awq_statistics(layer: torch.nn.Module) -> None:
    """Make ``layer``'s AWQ-lite statistics agree over TP and DP, once per stage (module docstring).

    Called on every rank at the same points (collective); does nothing outside AWQ-lite calibration.
    Stages: after the AWQ state is made (``weight_scale`` averaged over TP, or a row layer's made whole),
    after the caching forward loop (``act_scale`` weighted by this rank's token share), after the search
    (errors combined), after Model Optimizer smoothed the layer (a row layer smoothed again).
    """
    helper = getattr(layer, "awq_lite", None)
    if helper is None:
        return
    stage = getattr(helper, "_parallel_stage", None)
    cache_mode = bool(getattr(type(helper), "cache_mode", False))
    row = bool(getattr(layer, "_is_row_parallel", False))
    if stage is None:
        _average_weight_scale_over_tp(layer, helper)
        if row:
            _row_weight_scale_over_tp(layer, helper)
        helper._parallel_stage = "created"
    elif stage == "created" and cache_mode:
        _weight_act_scale_by_tokens(layer, helper)
        helper._parallel_stage = "cached"
    elif stage == "cached" and not cache_mode:
        _combine_losses(layer, helper)
        if row and helper.is_enabled and _group(layer.parallel_state.tensor_parallel_group) is not None:
            helper._weight_before_smoothing = layer.weight.detach().clone()
        helper._parallel_stage = "searched"
    elif stage == "searched" and not cache_mode and _smoothed(layer):
        helper._parallel_stage = "smoothed"  # before smoothing again, which re-enters this hook
        _resmooth_row_layer(layer, helper)
