"""GPU energy used by training, read from NVML's cumulative counter (Megatron-Core's ``energy_monitor``).

NVML reports each GPU's energy since the driver loaded, in millijoules; :class:`EnergyMonitor` sums
the increments while it runs (``resume`` starts, ``pause`` stops) and ``lap``/``get_total`` add the
per-rank sums over the default process group, in joules. ``setup`` binds the monitor to the current
CUDA device and raises when that is impossible (no ``nvidia-ml-py``, no CUDA device, no driver):
asking for energy where none can be measured is an error, not a silent zero. Before ``setup`` (and
after ``shutdown``) nothing is measured, so ``pause``/``resume`` are free to call unconditionally.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._nvml import open_current_device
from megatron_core.device import get_current_device

__all__ = ["EnergyMonitor"]


class EnergyMonitor:
    """Measures this rank's GPU energy between ``resume`` and ``pause``; sums it over all ranks.

    Every rank of the default process group must call ``lap`` and ``get_total`` together (they
    all-reduce); without an initialised ``torch.distributed`` they return this rank's energy.
    """

    def __init__(self) -> None:
        """A monitor that measures nothing until ``setup`` and ``resume``."""
        self._total_energy = 0  # mJ, closed laps of this rank
        self._lap_energy = 0  # mJ, measured in the open lap before the last pause
        self._last_energy = 0  # mJ, counter reading where the running interval began
        self._running = False
        self._nvml: ModuleType | None = None
        self._handle: Any = None
        self._read_failed = False

    def setup(self) -> None:
        """Bind to the current CUDA device's NVML counter; ``ImportError``/``RuntimeError`` naming what is missing."""
        if self._handle is not None:
            return
        self._nvml, self._handle = open_current_device("EnergyMonitor")
        self._last_energy = self._get_energy()

    def shutdown(self) -> None:
        """Release NVML; totals measured so far stay readable."""
        if self._nvml is not None:
            self.pause()
            self._nvml.nvmlShutdown()
        self._nvml, self._handle = None, None

    def pause(self) -> None:
        """Stop measuring (until ``resume``); the energy so far is kept for the current lap."""
        if self._running:
            self._lap_energy += self._get_energy() - self._last_energy
            self._running = False

    def resume(self) -> None:
        """Start (or restart) measuring from the counter's current value."""
        if self._handle is not None:
            self._last_energy = self._get_energy()
            self._running = True

    def lap(self) -> float:
        """Energy (J) of the lap just ended, summed over ranks; it is added to the total and a new lap begins."""
        if self._running:
            energy = self._get_energy()
            self._lap_energy += energy - self._last_energy
            self._last_energy = energy
        lap_energy, self._lap_energy = self._lap_energy, 0
        self._total_energy += lap_energy
        return _sum_over_ranks(lap_energy) / 1000.0

    def get_total(self) -> float:
        """Energy (J) of all closed laps, summed over ranks."""
        return _sum_over_ranks(self._total_energy) / 1000.0

    def _get_energy(self) -> int:
        """The counter (mJ); on an NVML error the last reading, so the failed interval counts as zero."""
        if self._handle is None:
            return self._last_energy
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except self._nvml.NVMLError as error:
            if not self._read_failed:
                self._read_failed = True
                warnings.warn(f"EnergyMonitor: reading the energy counter failed ({error}); "
                              "intervals whose reading fails count as zero", RuntimeWarning, stacklevel=3)
            return self._last_energy


def _sum_over_ranks(value_mj: int) -> int:
    """``value_mj`` summed over the default process group (itself without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value_mj
    tensor = torch.tensor([value_mj], dtype=torch.int64, device=get_current_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return int(tensor.item())
