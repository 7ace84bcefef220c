"""Multi-token-prediction numbers for the training log: each depth's loss and next-token acceptance rate."""

from __future__ import annotations

import argparse

import torch

from megatron_core.transformer.multi_token_prediction import MTPLossLoggingHelper


def mtp_log_values(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """This step's MTP metrics reduced over the data-parallel ranks (a collective) as unread device scalars:
    ``mtp_<k> loss`` (averaged over micro-batches) and ``mtp_<k> acceptance %``; clears the tracker."""
    MTPLossLoggingHelper.reduce_metrics_in_tracker()
    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return {}
    losses = tracker["loss_values"] / args.num_microbatches
    rates = tracker["correct_values"] / tracker["total_values"].clamp(min=1) * 100.0
    values = {}
    for depth in range(losses.shape[0]):
        values[f"mtp_{depth + 1} loss"] = losses[depth].clone()
        values[f"mtp_{depth + 1} acceptance %"] = rates[depth].clone()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return values
