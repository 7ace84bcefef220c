"""MoE numbers for the training log: aux / z losses and load imbalance, averaged over micro-batches and MoE layers."""

from __future__ import annotations

import argparse

import torch

from megatron_core.transformer.moe import get_moe_metrics_tracker


def _tracked_names(args: argparse.Namespace) -> list[str]:
    names = ["load_imbalance"]
    if args.moe_aux_loss_coeff > 0:
        names.append({"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                      "global_aux_loss": "global_load_balancing_loss"}.get(args.moe_router_load_balancing_type, ""))
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return [n for n in names if n]


def moe_log_values(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """This step's MoE metrics reduced over every rank (a collective) as unread device scalars; clears them.

    The loop reads them with the step's other results at its next log line.
    """
    return get_moe_metrics_tracker().reduce_on_device(
        loss_scale=1.0 / args.num_microbatches, force_initialize=True, track_names=_tracked_names(args),
        num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq)
