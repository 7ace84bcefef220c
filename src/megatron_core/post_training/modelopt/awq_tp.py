"""AWQ-lite's statistics of a parallel layer made those of the whole layer and all the data (TP=N, DP=N equal one process).

Model Optimizer's ``awq_lite`` searches, per linear layer, the exponent ``alpha`` of the per-input-channel
scales ``s = act_scale**alpha / weight_scale**(1 - alpha)`` that minimises the layer's output error. Under
Megatron-style parallelism each rank computes its inputs from its own part of the layer and of the data:

* tensor parallelism: a column-parallel layer (weight ``[out / TP, in]``, the input replicated over TP)
  computes ``weight_scale`` (the mean over the weight's rows of ``|w| / amax(|w| of its block)``, per input
  channel) and the output error of each ``alpha`` (the mean squared error of its output columns) from this
  rank's rows only, then each rank picks its own ``alpha`` and Model Optimizer averages the scales over TP.
  Averaging both statistics over TP first gives every rank the whole layer's (every rank holds as many
  rows and output columns, so the average of the per-rank means is the layer's mean). A row-parallel
  layer needs nothing: its statistics belong to its own input channels and its output error is taken
  after the all-reduce. (Its scales are normalised by this rank's largest and smallest scale rather than
  the whole layer's; that constant cancels between the input's ``1 / s`` and the weight's ``s``.)
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
runs at each entry and exit and acts once per stage.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sync_awq_statistics"]


def _group(group: Any) -> Any:
    """A Model Optimizer process group when it spans more than one rank, else ``None``."""
    if group is None or not group.is_initialized() or group.world_size() <= 1:
        return None
    return group


def _average_weight_scale_over_tp(layer: torch.nn.Module, helper: Any) -> None:
    group = _group(layer.parallel_state.tensor_parallel_group)
    if group is None or not getattr(layer, "_is_column_parallel", False) or not torch.is_tensor(helper.weight_scale):
        return
    torch.distributed.all_reduce(helper.weight_scale, group=group.group)
    helper.weight_scale /= group.world_size()


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


def sync_awq_statistics(layer: torch.nn.Module) -> None:
    """Make ``layer``'s AWQ-lite statistics agree over TP and DP, once per stage (module docstring).

    Called on every rank at the same points (collective); does nothing outside AWQ-lite calibration.
    Stages: after the AWQ state is made (``weight_scale`` averaged over TP), after the caching forward
    loop (``act_scale`` weighted by this rank's token share), after the search (errors combined).
    """
    helper = getattr(layer, "awq_lite", None)
    if helper is None:
        return
    stage = getattr(helper, "_parallel_stage", None)
    cache_mode = bool(getattr(type(helper), "cache_mode", False))
    if stage is None:
        _average_weight_scale_over_tp(layer, helper)
        helper._parallel_stage = "created"
    elif stage == "created" and cache_mode:
        _weight_act_scale_by_tokens(layer, helper)
        helper._parallel_stage = "cached"
    elif stage == "cached" and not cache_mode:
        _combine_losses(layer, helper)
        helper._parallel_stage = "searched"
