"""The multi-token prediction metrics for the training logs (Megatron-Core's ``MTPLossLoggingHelper`` of
``transformer.multi_token_prediction``, which re-exports it).

Per depth: the loss, and how often the depth's argmax equals its label (logged as the acceptance rate), summed
over micro-batches in one class-level tracker, reduced over the data-parallel ranks when the training loop logs,
and reported for the step and cumulatively.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_size

__all__ = ["MTPLossLoggingHelper", "mtp_acceptance_counts"]


class MTPLossLoggingHelper:
    """Per-depth MTP losses and next-token acceptance counts, accumulated over micro-batches for the logs."""

    tracker: dict[str, Any] = {}

    @staticmethod
    def save_metrics_to_tracker(loss: torch.Tensor, correct: torch.Tensor, total: torch.Tensor, layer_number: int,
                                num_layers: int, reduce_group: Any = None, avg_group: Any = None) -> None:
        """Add one micro-batch's loss and counts of depth ``layer_number`` (0-based)."""
        if layer_number is None:
            return
        tracker = MTPLossLoggingHelper.tracker
        for name in ("loss_values", "correct_values", "total_values"):
            if name not in tracker or tracker[name].shape != (num_layers,):  # first use, or another depth count
                tracker[name] = torch.zeros(num_layers, device=loss.device)
            elif tracker[name].device != loss.device:  # a model moved to another device keeps its sums
                tracker[name] = tracker[name].to(loss.device)
        tracker["loss_values"][layer_number] += loss.detach().float()
        tracker["correct_values"][layer_number] += correct.detach().float()
        tracker["total_values"][layer_number] += total.detach().float()
        tracker["reduce_group"], tracker["avg_group"] = reduce_group, avg_group

    @staticmethod
    def clean_metrics_in_tracker() -> None:
        """Zero the accumulated metrics."""
        tracker = MTPLossLoggingHelper.tracker
        for name in ("loss_values", "correct_values", "total_values"):
            if name in tracker:
                tracker[name].zero_()
        tracker["reduce_group"] = tracker["avg_group"] = None

    @staticmethod
    def reduce_metrics_in_tracker() -> None:
        """Sum over ``reduce_group``; average the losses and sum the counts over ``avg_group``."""
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return
        for name, avg_op in (("loss_values", dist.ReduceOp.AVG), ("correct_values", dist.ReduceOp.SUM),
                             ("total_values", dist.ReduceOp.SUM)):
            values = tracker[name]
            if tracker.get("reduce_group") is not None:
                dist.all_reduce(values, group=tracker["reduce_group"])
            if tracker.get("avg_group") is not None:
                if avg_op == dist.ReduceOp.AVG and dist.get_backend(tracker["avg_group"]) == "gloo":
                    dist.all_reduce(values, group=tracker["avg_group"])  # gloo has no AVG
                    values /= get_pg_size(tracker["avg_group"])
                else:
                    dist.all_reduce(values, group=tracker["avg_group"], op=avg_op)

    @staticmethod
    def track_mtp_metrics(loss_scale: float, iteration: int, writer: Any, wandb_writer: Any = None,
                          total_loss_dict: dict | None = None) -> None:
        """Reduce, then log ``mtp_<k> loss`` and the acceptance rates (this step's and cumulative), and clean."""
        MTPLossLoggingHelper.reduce_metrics_in_tracker()
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return
        losses = tracker["loss_values"] * loss_scale
        correct, total = tracker["correct_values"], tracker["total_values"]
        if tracker.get("cumulative_correct_values") is None or tracker["cumulative_correct_values"].shape != correct.shape:
            tracker["cumulative_correct_values"] = torch.zeros_like(correct)
            tracker["cumulative_total_values"] = torch.zeros_like(total)
        tracker["cumulative_correct_values"] += correct
        tracker["cumulative_total_values"] += total
        for depth in range(losses.shape[0]):
            name = f"mtp_{depth + 1}"
            rate = correct[depth] / total[depth].clamp(min=1) * 100.0
            cumulative = (tracker["cumulative_correct_values"][depth]
                          / tracker["cumulative_total_values"][depth].clamp(min=1) * 100.0)
            if total_loss_dict is not None:
                total_loss_dict[f"{name} loss"] = total_loss_dict.get(f"{name} loss", 0) + losses[depth]
            values = {f"{name} loss": losses[depth], f"{name}_acceptance_rate": rate,
                      f"{name}_cumulative_acceptance_rate": cumulative}
            if writer is not None:
                for key, value in values.items():
                    writer.add_scalar(key, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log(values, iteration)
        MTPLossLoggingHelper.clean_metrics_in_tracker()


def mtp_acceptance_counts(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, vocab_sharded: bool,
                          tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """How many valid positions' argmax equals the label, and how many valid positions (``logits [s, b, V']``)."""
    with torch.no_grad():
        if vocab_sharded and get_pg_size(tp_group) > 1:
            local_max, local_arg = logits.max(dim=-1)
            maxima = [torch.empty_like(local_max) for _ in range(get_pg_size(tp_group))]
            args = [torch.empty_like(local_arg) for _ in range(get_pg_size(tp_group))]
            dist.all_gather(maxima, local_max, group=tp_group)
            dist.all_gather(args, local_arg, group=tp_group)
            winner = torch.stack(maxima).argmax(dim=0)
            preds = winner * logits.shape[-1] + torch.stack(args).gather(0, winner.unsqueeze(0)).squeeze(0)
        else:
            preds = logits.argmax(dim=-1)
        valid = loss_mask.transpose(0, 1).bool()
        correct = ((preds == labels.transpose(0, 1)) & valid).sum().float()
        return correct, valid.sum().float()
