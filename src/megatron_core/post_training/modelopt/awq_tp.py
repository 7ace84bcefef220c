"""AWQ-lite's statistics of a column-parallel layer made those of the whole layer (TP=N equals one process).

Model Optimizer's ``awq_lite`` searches, per linear layer, the exponent ``alpha`` of the per-input-channel
scales ``s = act_scale**alpha / weight_scale**(1 - alpha)`` that minimises the layer's output error. For a
column-parallel layer (weight ``[out / TP, in]``, the input replicated over TP) it computes two of its
three inputs from this rank's output rows only:

* ``weight_scale``: the mean over the weight's rows of ``|w| / amax(|w| of its block)``, per input channel;
* the output error of each ``alpha``: the mean squared error of this rank's output columns.

Each rank then picks its own best ``alpha`` and Model Optimizer averages the resulting scales over TP, so
the scales differ from one process's (by 1-7 % on a tiny GPT, 0.11 in the logits). With both statistics
averaged over TP first (every rank holds the same number of rows and output columns, so the average of
the per-rank means is the whole layer's mean) every rank finds the one-process ``alpha`` and scales, and
Model Optimizer's own average over TP leaves them unchanged.

A row-parallel layer needs nothing: its activation and weight statistics belong to its own input channels,
and its output error is taken after the all-reduce, so it is the whole layer's already. (Its scales are
normalised by this rank's largest and smallest scale rather than the whole layer's; that constant cancels
between the input's ``1 / s`` and the weight's ``s``.)

Model Optimizer gives a layer the chance through ``enable_weight_access_and_writeback``, a context it
enters around creating a layer's AWQ state and around choosing its scales (:func:`sync_awq_statistics`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sync_awq_statistics"]


def _tp_group(layer: torch.nn.Module) -> Any:
    """The layer's TP process group when it spans more than one rank, else ``None``."""
    group = layer.parallel_state.tensor_parallel_group
    if not group.is_initialized() or group.world_size() <= 1:
        return None
    return group


def sync_awq_statistics(layer: torch.nn.Module) -> None:
    """Average a column-parallel ``layer``'s AWQ-lite weight statistics and search errors over TP, once each.

    Called on every TP rank at the same points (collective); does nothing outside AWQ-lite calibration,
    for row-parallel layers, and without TP.
    """
    helper = getattr(layer, "awq_lite", None)
    if helper is None or not getattr(layer, "_is_column_parallel", False):
        return
    group = _tp_group(layer)
    if group is None:
        return
    size = group.world_size()
    if not getattr(helper, "_tp_weight_scale_synced", False) and torch.is_tensor(helper.weight_scale):
        torch.distributed.all_reduce(helper.weight_scale, group=group.group)
        helper.weight_scale /= size
        helper._tp_weight_scale_synced = True
    if helper.num_search_steps > 0 and not getattr(helper, "_tp_loss_synced", False):
        alphas = list(helper.loss)
        losses = torch.stack([torch.as_tensor(helper.loss[a], dtype=torch.float32) for a in alphas])
        torch.distributed.all_reduce(losses, group=group.group)
        losses /= size
        helper.loss.update({a: losses[i] for i, a in enumerate(alphas)})
        helper._tp_loss_synced = True
