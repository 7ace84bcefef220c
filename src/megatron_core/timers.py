"""Named wall-clock timers with cross-rank min/max reports (Megatron-Core's ``timers``).

``timers = Timers(log_level=1, log_option="minmax")``; ``timers("forward", log_level=1).start()`` /
``.stop()``; ``timers.log(["forward"], normalizer=iters)`` logs, on one rank, each timer's time per
rank reduced to max, (min, max) or every rank, in milliseconds. A timer whose level is above the
``Timers`` level is a no-op ``DummyTimer``. Every rank must call ``log``/``write``/``get_all_timers_string``
with the same names (they all-gather). Works with or without ``torch.distributed``; the device is
synchronised before each reading (a no-op on CPU).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any

import torch

from megatron_core import device

logger = logging.getLogger(__name__)

_LOG_OPTIONS = ("max", "minmax", "all")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class TimerBase(ABC):
    """Interface of one named timer."""

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def start(self, barrier: bool = False) -> None:
        """Start timing."""

    @abstractmethod
    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the span to the elapsed total."""

    @abstractmethod
    def reset(self) -> None:
        """Zero the elapsed total."""

    @abstractmethod
    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated (a running span is included and keeps running)."""


class DummyTimer(TimerBase):
    """What a disabled timer is: every call does nothing."""

    def __init__(self) -> None:
        super().__init__("dummy timer")

    def start(self, barrier: bool = False) -> None:
        """Do nothing."""

    def stop(self, barrier: bool = False) -> None:
        """Do nothing."""

    def reset(self) -> None:
        """Do nothing."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Raise: a disabled timer has no time to report."""
        raise RuntimeError("a DummyTimer (log level above the Timers level) has no elapsed time")

    def active_time(self) -> float:
        """Raise: a disabled timer has no time to report."""
        raise RuntimeError("a DummyTimer (log level above the Timers level) has no active time")


class Timer(TimerBase):
    """A start/stop timer; ``barrier=True`` first waits for every rank of its barrier group."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._barrier_group: Any = None
        self._start_time = time.time()

    def set_barrier_group(self, barrier_group: Any) -> None:
        """Group the barrier waits on (None: the default group)."""
        self._barrier_group = barrier_group

    def _sync(self, barrier: bool) -> None:
        if barrier and _distributed():
            torch.distributed.barrier(group=self._barrier_group)
        device.synchronize()

    def start(self, barrier: bool = False) -> None:
        """Start timing; ``RuntimeError`` if already started."""
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        self._sync(barrier)
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        """Stop timing; ``RuntimeError`` if not started."""
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        self._sync(barrier)
        span = time.time() - self._start_time
        self._elapsed += span
        self._active_time += span
        self._started = False

    def reset(self) -> None:
        """Zero the elapsed total (the lifetime active time is kept)."""
        self._elapsed = 0.0
        self._started = False

    def set_elapsed(self, value: float) -> None:
        """Set the elapsed total directly (seconds)."""
        self._elapsed = value

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated; a running timer is stopped, read and restarted."""
        running = self._started
        if running:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        """Seconds this timer has run in its lifetime (not cleared by ``reset``)."""
        return self._active_time


class Timers:
    """A registry of named timers with a verbosity level and a cross-rank report format."""

    _max_log_level = 2

    def __init__(self, log_level: int, log_option: str) -> None:
        if log_option not in _LOG_OPTIONS:
            raise ValueError(f"Timers: log_option={log_option!r} must be one of {_LOG_OPTIONS}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timer = DummyTimer()

    def __call__(self, name: str, log_level: int | None = None) -> TimerBase:
        """The timer ``name`` (made on first use at ``log_level``, default 2); a DummyTimer when filtered."""
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(f"timer {name!r} has log level {self._log_levels[name]}, not {log_level}")
            return self._timers[name]
        if log_level is None:
            log_level = self._max_log_level
        if log_level > self._max_log_level:
            raise ValueError(f"log_level={log_level} exceeds the maximum {self._max_log_level}")
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _get_elapsed_time_all_ranks(self, names: list[str], reset: bool, barrier: bool) -> torch.Tensor | None:
        """``[world_size, len(names)]`` seconds per rank and timer (0 where a rank lacks the timer)."""
        names = list(names)
        if not names:
            return None
        if barrier and _distributed():
            torch.distributed.barrier()
        world = torch.distributed.get_world_size() if _distributed() else 1
        mine = torch.zeros(len(names), dtype=torch.float64)
        for i, name in enumerate(names):
            if name in self._timers:
                mine[i] = self._timers[name].elapsed(reset=reset)
        if world == 1:
            return mine.unsqueeze(0)
        dev = device.get_current_device()
        out = torch.zeros(world * len(names), dtype=torch.float64, device=dev)
        torch.distributed.all_gather_into_tensor(out, mine.to(dev))
        return out.view(world, len(names)).cpu()

    def _get_global_min_max_time(self, names: list[str], reset: bool, barrier: bool,
                                 normalizer: float) -> dict[str, tuple[float, float]]:
        """name -> (min, max) over the ranks that recorded it, divided by ``normalizer``."""
        names = list(names)
        table = self._get_elapsed_time_all_ranks(names, reset, barrier)
        result = {}
        if table is None:
            return result
        for i, name in enumerate(names):
            values = [v for v in table[:, i].tolist() if v > 0.0]
            if values:
                result[name] = (min(values) / normalizer, max(values) / normalizer)
        return result

    def get_all_timers_string(self, names: list[str] | None = None, normalizer: float = 1.0,
                              reset: bool = True, barrier: bool = False) -> str | None:
        """The report text (times in ms divided by ``normalizer``), or None when nothing was timed."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer={normalizer} must be > 0")
        names = list(self._timers) if names is None else list(names)
        scale = normalizer / 1000.0
        if self._log_option in ("max", "minmax"):
            extremes = self._get_global_min_max_time(names, reset, barrier, scale)
            if not extremes:
                return None
            max_only = self._log_option == "max"
            text = "max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"
            for name, (lo, hi) in extremes.items():
                label = (name + " ").ljust(48, ".")
                text += f"\n    {label}: {hi:.2f}" if max_only else f"\n    {label}: ({lo:.2f}, {hi:.2f})"
            return text
        table = self._get_elapsed_time_all_ranks(names, reset, barrier)
        if table is None:
            return None
        text, found = "times across ranks (ms):", False
        for i, name in enumerate(names):
            rows = [(r, v) for r, v in enumerate(table[:, i].tolist()) if v > 0]
            if rows:
                found = True
                text += f"\n  {name}:" + "".join(f"\n     rank {r:2d}: {v / scale:.2f}" for r, v in rows)
        return text if found else None

    def log(self, names: list[str], rank: int | None = None, normalizer: float = 1.0, reset: bool = True,
            barrier: bool = False) -> None:
        """Log the report on ``rank`` (default: the last rank); every rank must call it."""
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        world = torch.distributed.get_world_size() if _distributed() else 1
        me = torch.distributed.get_rank() if _distributed() else 0
        if (world - 1 if rank is None else rank) == me and text is not None:
            logger.info(text)

    def write(self, names: list[str], writer: Any, iteration: int, normalizer: float = 1.0, reset: bool = True,
              barrier: bool = False) -> None:
        """Write each timer's max over ranks as ``<name>-time`` to a TensorBoard writer or a wandb-like logger."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer={normalizer} must be > 0")
        extremes = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is None:
            return
        for name, (_, hi) in extremes.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name + "-time", hi, iteration)
            elif hasattr(writer, "log"):
                writer.log({name + "-time": hi}, iteration)
