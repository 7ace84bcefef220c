"""Multi-token-prediction numbers for the training log: each depth's loss and next-token acceptance rate."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron_core.utils import get_pg_size


def mtp_log_values(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """This step's MTP metrics reduced over the data-parallel (and pipeline) ranks (collectives) as unread device scalars:
    ``mtp_<k> loss`` (averaged over micro-batches) and ``mtp_<k> acceptance %``; clears the tracker."""
    MTPLossLoggingHelper.reduce_metrics_in_tracker()
    tracker = MTPLossLoggingHelper.tracker
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if get_pg_size(pp_group) > 1:
        # Only the last stage runs the MTP layers: every stage takes its numbers (zeros elsewhere, summed).
        depths = args.mtp_num_layers
        for name in ("loss_values", "correct_values", "total_values"):
            if name not in tracker or tracker[name].shape != (depths,):
                tracker[name] = torch.zeros(depths, device=device.get_current_device())
            dist.all_reduce(tracker[name], group=pp_group)
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
