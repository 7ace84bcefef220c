"""Per-layer MoE metrics (aux losses, z-loss, load imbalance) and their reporting (Megatron-Core's ``moe_logging``).

Routers :meth:`~MoEMetricsTracker.record` a scalar per layer during the forward; the training loop
calls :meth:`~MoEMetricsTracker.report` once per step, which reduces the values across ranks
(sum over the metric's ``reduce_group``, average over its ``avg_group``, then over data
parallel ranks and a sum over pipeline stages), averages over MoE layers, formats a log string
and clears the values. :meth:`~MoEMetricsTracker.reduce_on_device` (an extension) does the same
without reading anything on the host, for loops that read the values only when they log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_size
from megatron_core.process_groups_config import resolve_process_group

__all__ = ["MetricEntry", "MoEMetricsTracker", "destroy_moe_metrics_tracker", "get_moe_metrics_tracker",
           "set_moe_metrics_tracker"]


@dataclass
class MetricEntry:
    """A metric's per-layer values and how to reduce them across ranks."""

    values: torch.Tensor
    reduce_group: Any = None
    avg_group: Any = None
    needs_dp_avg: bool = True


_TRACKER: MoEMetricsTracker | None = None


def get_moe_metrics_tracker() -> MoEMetricsTracker:
    """The process-wide tracker (created on first use)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = MoEMetricsTracker()
    return _TRACKER


def set_moe_metrics_tracker(tracker: MoEMetricsTracker) -> None:
    """Replace the process-wide tracker."""
    global _TRACKER
    _TRACKER = tracker


def destroy_moe_metrics_tracker() -> None:
    """Forget the process-wide tracker."""
    global _TRACKER
    _TRACKER = None


def _reduce(tensor: torch.Tensor, group: Any, average: bool = False) -> None:
    if get_pg_size(group) > 1:
        dist.all_reduce(tensor, group=group)
        if average:
            tensor.div_(get_pg_size(group))


class MoEMetricsTracker:
    """Accumulates per-layer MoE metrics between two reports."""

    def __init__(self) -> None:
        self._metrics: dict[str, MetricEntry] = {}

    @property
    def metrics(self) -> dict[str, MetricEntry]:
        """The metric entries by name."""
        return self._metrics

    def record(self, name: str, value: torch.Tensor, layer_number: int | torch.Tensor | None, num_layers: int,
               reduce_group: Any = None, avg_group: Any = None, needs_dp_avg: bool = True) -> None:
        """Add ``value`` to ``name``'s entry for the 1-based ``layer_number`` (ignored when None).

        ``layer_number`` may be a one-element integer tensor on ``value``'s device: compiled callers pass it so
        that their graph does not depend on which layer records.
        """
        if layer_number is None:
            return
        if name not in self._metrics:
            self._metrics[name] = MetricEntry(values=torch.zeros(num_layers, device=value.device))
        entry = self._metrics[name]
        if entry.values.device != value.device:  # follow the model's device once, never copy per record
            entry.values = entry.values.to(value.device)
        if entry.values.numel() < num_layers:  # a model with more layers than the one that made the entry
            entry.values = torch.cat([entry.values, entry.values.new_zeros(num_layers - entry.values.numel())])
        value = value.detach().float()
        if isinstance(layer_number, torch.Tensor):
            entry.values.index_add_(0, layer_number.reshape(1) - 1, value.reshape(1))
        else:
            entry.values[layer_number - 1] += value
        entry.reduce_group, entry.avg_group, entry.needs_dp_avg = reduce_group, avg_group, needs_dp_avg

    def ensure_initialized(self, name: str, num_layers: int, device: Any = "cpu") -> None:
        """Create ``name``'s entry (zeros) if missing, so ranks without MoE layers join the reductions."""
        if name not in self._metrics:
            self._metrics[name] = MetricEntry(values=torch.zeros(num_layers, device=device))

    def clear(self) -> None:
        """Zero every metric (entries are kept)."""
        for entry in self._metrics.values():
            entry.values.zero_()

    def _sync(self, names: list[str], pg_collection: Any) -> None:
        pp = resolve_process_group("pp", pg_collection)
        dp = resolve_process_group("dp", pg_collection)
        for name in names:
            entry = self._metrics[name]
            _reduce(entry.values, pp)
            _reduce(entry.values, entry.reduce_group)
            _reduce(entry.values, entry.avg_group, average=True)
            if entry.needs_dp_avg:
                _reduce(entry.values, dp, average=True)

    def _reduced_per_layer(self, loss_scale: float, force_initialize: bool, track_names: str | list[str] | None,
                           num_layers: int | None, mtp_num_layers: int | None, pg_collection: Any
                           ) -> dict[str, torch.Tensor]:
        """Each tracked metric reduced across ranks, per layer, times ``loss_scale`` (new tensors, nothing read)."""
        names = [track_names] if isinstance(track_names, str) else list(track_names or self._metrics)
        if force_initialize:
            if num_layers is None:
                raise ValueError("num_layers must be given with force_initialize=True")
            for name in names:
                self.ensure_initialized(name, num_layers + (mtp_num_layers or 0))
        names = [n for n in names if n in self._metrics]
        self._sync(names, pg_collection)
        return {name: self._metrics[name].values * loss_scale for name in names}

    def reduce_on_device(self, loss_scale: float, force_initialize: bool = False,
                         track_names: str | list[str] | None = None, num_layers: int | None = None,
                         moe_layer_freq: int | list[int] | None = None, mtp_num_layers: int | None = None,
                         pg_collection: Any = None) -> dict[str, torch.Tensor]:
        """:meth:`report`'s values as 0-dim device tensors, unread (an extension), then clear.

        Reduced across ranks (a collective: every rank calls it) and averaged over MoE layers, times
        ``loss_scale``. A loop that reads them only when it logs does not wait for the GPU after each step.
        """
        per_layer = self._reduced_per_layer(loss_scale, force_initialize, track_names, num_layers, mtp_num_layers,
                                            pg_collection)
        means = {name: _layer_mean(values, num_layers, moe_layer_freq) for name, values in per_layer.items()}
        self.clear()
        return means

    def report(self, loss_scale: float, iteration: int, writer: Any = None, wandb_writer: Any = None,
               per_layer_logging: bool = False, force_initialize: bool = False,
               track_names: str | list[str] | None = None, num_layers: int | None = None,
               moe_layer_freq: int | list[int] | None = None, mtp_num_layers: int | None = None,
               total_loss_dict: dict[str, torch.Tensor] | None = None, percentiles: dict | None = None,
               pg_collection: Any = None) -> str:
        """Reduce, average over MoE layers (times ``loss_scale``), log, clear; returns ``"name: value | ..."``."""
        per_layer = self._reduced_per_layer(loss_scale, force_initialize, track_names, num_layers, mtp_num_layers,
                                            pg_collection)
        scalars: dict[str, float] = {}
        for name, values in per_layer.items():
            scalars[name] = float(_layer_mean(values, num_layers, moe_layer_freq))
            if writer is not None:
                writer.add_scalar(name, scalars[name], iteration)
                if per_layer_logging:
                    for i, v in enumerate(values.tolist()):
                        writer.add_scalar(f"moe/{name}_layer_{i}", v, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: scalars[name]}, iteration)
        console = dict(scalars)
        if total_loss_dict is not None:
            for key, value in scalars.items():
                if key.lower().endswith("loss"):
                    total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value
                    console.pop(key)
        self.clear()
        return " | ".join(f"{k}: {v:.6E}" for k, v in console.items())


def _layer_mean(values: torch.Tensor, num_layers: int | None, moe_layer_freq: int | list[int] | None) -> torch.Tensor:
    """The per-layer ``values`` summed and divided by the number of MoE layers among them (a 0-dim tensor)."""
    return values.sum() / max(_count_moe_layers(values.numel(), num_layers, moe_layer_freq), 1)


def _count_moe_layers(size: int, num_layers: int | None, moe_layer_freq: int | list[int] | None) -> int:
    if num_layers is None or moe_layer_freq is None:
        return size
    if isinstance(moe_layer_freq, int):
        return sum(1 for i in range(num_layers) if i % moe_layer_freq == 0) + max(size - num_layers, 0)
    return sum(moe_layer_freq) + max(size - num_layers, 0)
