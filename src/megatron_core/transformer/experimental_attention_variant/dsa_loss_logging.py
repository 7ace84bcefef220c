"""The DSA indexer loss for the training logs (Megatron-Core's ``dsa.DSAIndexerLossLoggingHelper``).

Each DSA layer adds its indexer loss of a micro-batch into one class-level per-layer tracker; when the training
loop logs, the values are summed over pipeline stages (each stage filled its own layers), reduced over the
layer's ``reduce_group`` / ``avg_group`` and averaged over data-parallel ranks, then the mean over layers is
logged as ``"indexer loss"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core._ground import get_pg_size

__all__ = ["DSAIndexerLossLoggingHelper"]


def _all_reduce_avg(values: torch.Tensor, group: Any) -> None:
    """In-place average over ``group`` (gloo has no AVG: sum, then divide)."""
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(values, group=group)
        values /= get_pg_size(group)
    else:
        dist.all_reduce(values, group=group, op=dist.ReduceOp.AVG)


class DSAIndexerLossLoggingHelper:
    """Per-layer indexer losses accumulated over micro-batches for the logs."""

    tracker: dict[str, Any] = {}

    @staticmethod
    def save_loss_to_tracker(loss: torch.Tensor, layer_number: int | None, num_layers: int, reduce_group: Any = None,
                             avg_group: Any = None) -> None:
        """Add ``loss`` to layer ``layer_number`` (1-based; None: not tracked)."""
        if layer_number is None:
            return
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker or tracker["values"].shape != (num_layers,):
            tracker["values"] = torch.zeros(num_layers, device=loss.device)
        tracker["values"][layer_number - 1] += loss.detach().float()
        tracker["reduce_group"], tracker["avg_group"] = reduce_group, avg_group

    @staticmethod
    def clean_loss_in_tracker() -> None:
        """Zero the accumulated losses."""
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" in tracker:
            tracker["values"].zero_()
        tracker["reduce_group"] = tracker["avg_group"] = None

    @staticmethod
    def reduce_loss_in_tracker() -> None:
        """Sum over pipeline stages and ``reduce_group``, average over ``avg_group`` and data-parallel ranks (no-op
        without ``torch.distributed``)."""
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker or not (dist.is_available() and dist.is_initialized()):
            return
        values = tracker["values"]
        if parallel_state.model_parallel_is_initialized():
            dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        if tracker.get("reduce_group") is not None:
            dist.all_reduce(values, group=tracker["reduce_group"])
        if tracker.get("avg_group") is not None:
            _all_reduce_avg(values, tracker["avg_group"])
        if parallel_state.model_parallel_is_initialized():
            _all_reduce_avg(values, parallel_state.get_data_parallel_group(with_context_parallel=False))

    @staticmethod
    def track_indexer_metrics(loss_scale: float, iteration: int, writer: Any, wandb_writer: Any = None,
                              total_loss_dict: dict | None = None, per_layer_logging: bool = False) -> None:
        """Reduce, log the mean over layers (times ``loss_scale``) as ``"indexer loss"``, and clean.

        ``per_layer_logging`` is accepted as in Megatron-Core, which logs only the mean as well.
        """
        DSAIndexerLossLoggingHelper.reduce_loss_in_tracker()
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        values = tracker["values"] * loss_scale
        mean = values.sum() / values.shape[0]
        if total_loss_dict is not None:
            total_loss_dict["indexer loss"] = total_loss_dict.get("indexer loss", 0) + mean
        if writer is not None:
            writer.add_scalar("indexer loss", mean, iteration)
        if wandb_writer is not None:
            wandb_writer.log({"indexer loss": mean}, iteration)
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
