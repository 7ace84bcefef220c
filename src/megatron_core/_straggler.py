"""Per-rank timing of a chosen code region, reported as the slowest and fastest ranks (``StragglerDetector``).

Megatron-Core's ``utils.StragglerDetector``: a process-wide singleton, configured once, used as a context
manager around the region to time (``with stimer:``) or around data loading (``with stimer(bdata=True):``).
``report(total_flops, log_interval)`` gathers every rank's times to rank 0, logs min/max with the rank
that had them, and applies a pending on/off toggle on every rank.

Works on CPU (wall-clock ``perf_counter``) as well as CUDA (CUDA events as well; the larger is used).
The rank-0 HTTP control port of Megatron's version is not opened; set ``toggle = True`` on rank 0 instead.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any

import torch

from megatron_core import device

logger = logging.getLogger(__name__)


class _ValueWithRank:
    """A metric value with the rank it came from; orders by value, prints as ``value unit/rank``."""

    def __init__(self, value: float, rank: int, unit: str = "") -> None:
        self._value, self._rank, self._unit = value, rank, unit

    def __lt__(self, other: _ValueWithRank) -> bool:
        return self._value < other._value

    def __gt__(self, other: _ValueWithRank) -> bool:
        return self._value > other._value

    def __call__(self) -> tuple[float, int, str]:
        return self._value, self._rank, self._unit

    def __str__(self) -> str:
        return f"{self._value:.2f}{self._unit}/{self._rank}"


@dataclass
class _StragglerData:
    """Min/max of each metric over ranks, and every rank's throughput sorted ascending."""

    min_elapsed: _ValueWithRank = field(default_factory=lambda: _ValueWithRank(sys.float_info.max, 0, "ms"))
    max_elapsed: _ValueWithRank = field(default_factory=lambda: _ValueWithRank(sys.float_info.min, 0, "ms"))
    min_btime: _ValueWithRank = field(default_factory=lambda: _ValueWithRank(sys.float_info.max, 0, "ms"))
    max_btime: _ValueWithRank = field(default_factory=lambda: _ValueWithRank(sys.float_info.min, 0, "ms"))
    extremes: dict[str, tuple[_ValueWithRank, _ValueWithRank]] = field(default_factory=dict)
    aflops: list[_ValueWithRank] | None = None


_GPU_METRICS = (("temp", "C"), ("power", "W"), ("util", "%"), ("clock", "MHz"))


def _gpu_metrics() -> dict[str, float]:
    """Temperature, power, utilisation and clock of the current GPU; zeros on CPU or without pynvml."""
    values = {name: 0.0 for name, _ in _GPU_METRICS}
    if device.get_current_device().type != "cuda":
        return values
    for name, fn in (("temp", "temperature"), ("power", "power_draw"), ("util", "utilization"),
                     ("clock", "clock_rate")):
        try:
            values[name] = float(getattr(torch.cuda, fn)())
        except Exception:  # pynvml missing or unsupported: report 0
            pass
    return values


class StragglerDetector:
    """Singleton per-rank timer; see the module docstring for use."""

    _configured = False

    def __new__(cls) -> StragglerDetector:
        if "_instance" not in cls.__dict__:
            cls._instance = super().__new__(cls)
            cls._instance._initialised = False
        return cls._instance

    def __init__(self) -> None:
        if self._initialised:
            return
        self._initialised = True
        self._off = True
        self.start = self.null_method
        self.stop = self.null_method
        self.world, self.rank, self.mmcnt, self.amp, self.port = 0, 0, 1, 3.0, 0
        self.toggle = False
        self.bdata = False
        self._cuda = False
        self._spans: dict[str, list[list[Any]]] = {"gemm": [], "data": []}

    def configure(self, world: int, rank: int, mmcnt: int = 1, amp: float = 3.0, port: int = 65535,
                  prefill: int = 1024, enabled: bool = False) -> None:
        """Set world size, rank, how many extreme ranks to list (``mmcnt``) and the FLOPs factor ``amp``.

        Only the first call per process takes effect. ``enabled`` starts collecting at once;
        ``prefill`` is accepted for compatibility (events are made on demand).
        """
        if StragglerDetector._configured:
            return
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"StragglerDetector.configure: need world >= 1 and 0 <= rank < world, "
                             f"got world={world}, rank={rank}")
        StragglerDetector._configured = True
        self.world, self.rank = world, rank
        self.mmcnt = max(1, mmcnt)
        self.amp, self.port = amp, port
        self.toggle = self.bdata = False
        self._cuda = device.get_current_device().type == "cuda"
        self._spans = {"gemm": [], "data": []}
        self._set_state(off=not enabled)

    def _set_state(self, off: bool) -> None:
        self._off = off
        self.start = self.null_method if off else self.start_method
        self.stop = self.null_method if off else self.stop_method

    def reset(self) -> None:
        """Forget the spans collected since the last report."""
        self._spans = {"gemm": [], "data": []}
        self.bdata = False

    def start_method(self) -> None:
        """Start timing a span (a data span when called right after ``self(bdata=True)``)."""
        kind = "data" if self.bdata else "gemm"
        self.bdata = False
        events = None
        if self._cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        self._spans[kind].append([time.perf_counter_ns(), 0, events])

    def stop_method(self) -> None:
        """Stop the open span (a data span first, if one is open)."""
        for kind in ("data", "gemm"):
            spans = self._spans[kind]
            if spans and spans[-1][1] == 0:
                spans[-1][1] = time.perf_counter_ns()
                if spans[-1][2] is not None:
                    spans[-1][2][1].record()
                return

    @staticmethod
    def _span_ms(span: list[Any]) -> float:
        wall = (span[1] - span[0]) / 1e6
        if span[2] is not None:
            return max(wall, span[2][0].elapsed_time(span[2][1]))
        return wall

    def elapsed(self) -> tuple[float, float, float, float, float, float]:
        """(ms in timed spans, max ms in one data span, temp, power, util, clock) since the last reset; resets."""
        if self._off:
            return 0, 0, 0, 0, 0, 0
        open_spans = [k for k, spans in self._spans.items() if spans and spans[-1][1] == 0]
        if open_spans:
            logger.warning("StragglerDetector: start/stop out of sync for %s spans", open_spans)
            self.reset()
            return 0, 0, 0, 0, 0, 0
        metrics = _gpu_metrics()
        device.synchronize()
        delta = sum(self._span_ms(s) for s in self._spans["gemm"])
        batch_delta = max((self._span_ms(s) for s in self._spans["data"]), default=0.0)
        self.reset()
        return delta, batch_delta, metrics["temp"], metrics["power"], metrics["util"], metrics["clock"]

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """Gather per-rank metrics to rank 0 and log the extremes; every rank must call it.

        ``total_flops`` is this rank's theoretical FLOPs over ``log_interval`` iterations. Returns True
        on rank 0 when it logged a report. Afterwards a pending ``toggle`` (set on rank 0) switches
        collection on or off on every rank.
        """
        reported = False
        if not self._off and total_flops > 0.0 and log_interval > 0:
            elapsed, btime, temp, power, util, clock = self.elapsed()
            ptime = elapsed / log_interval
            per_iter_flops = total_flops / log_interval
            rank_tflops = per_iter_flops / (ptime * 10**9 * self.world) if ptime > 0 else 0.0
            data = self._min_max(ptime, btime, temp, power, util, clock, rank_tflops / self.amp)
            if self.rank == 0 and data is not None and data.aflops:
                reported = True
                self._log(data)
        self._check_toggle()
        return reported

    def _log(self, data: _StragglerData) -> None:
        now = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        parts = [f"[{now}]", f"MnRtt/Rnk: {data.min_elapsed}", f"MxRtt/Rnk: {data.max_elapsed}"]
        for name, (lo, hi) in data.extremes.items():
            parts += [f"Mn{name}/Rnk: {lo}", f"Mx{name}/Rnk: {hi}"]
        lo_f, lo_r, _ = data.aflops[0]()
        hi_f, hi_r, _ = data.aflops[-1]()
        parts += [f"MnDRtt/Rnk: {data.min_btime}", f"MxDRtt/Rnk: {data.max_btime}",
                  f"MnEtpt/Rnk: {lo_f:.2f}TF/{lo_r}", f"MxEtpt/Rnk: {hi_f:.2f}TF/{hi_r}"]
        logger.info(" | ".join(parts))
        if 1 < self.mmcnt < self.world:
            logger.info("^^^^ Bottom %d ranks by Etpt(TF): %s", self.mmcnt,
                        ", ".join(str(v) for v in data.aflops[: self.mmcnt]))
            logger.info("^^^^ Top %d ranks by Etpt(TF): %s", self.mmcnt,
                        ", ".join(str(v) for v in data.aflops[-self.mmcnt:]))

    def _distributed(self) -> bool:
        return self.world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    def _min_max(self, ptime: float, btime: float, temp: float, power: float, util: float, clock: float,
                 flops: float) -> _StragglerData | None:
        """Gather one record per rank to rank 0 and find each metric's extremes there."""
        if self._off:
            return None
        record = {"rank": self.rank, "time": ptime, "btime": btime, "temp": temp, "power": power,
                  "util": util, "clock": clock, "flops": flops}
        records = [record]
        if self._distributed():
            gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
            torch.distributed.gather_object(record, object_gather_list=gathered, dst=0)
            records = gathered if self.rank == 0 else []
        data = _StragglerData()
        if self.rank == 0:
            def extremes(key: str, unit: str) -> tuple[_ValueWithRank, _ValueWithRank]:
                lo = min(records, key=lambda r: r[key])
                hi = max(records, key=lambda r: r[key])
                return _ValueWithRank(lo[key], int(lo["rank"]), unit), _ValueWithRank(hi[key], int(hi["rank"]), unit)

            data.min_elapsed, data.max_elapsed = extremes("time", "ms")
            data.min_btime, data.max_btime = extremes("btime", "ms")
            for (name, unit), label in zip(_GPU_METRICS, ("Tmp", "Pwr", "Utl", "Clk")):
                data.extremes[label] = extremes(name, unit)
            data.aflops = sorted(_ValueWithRank(r["flops"], int(r["rank"])) for r in records)
        if self._distributed():
            torch.distributed.barrier()
        return data

    def _check_toggle(self) -> None:
        """Apply rank 0's pending toggle on every rank (a broadcast when distributed)."""
        off = self._off
        if self.rank == 0 and self.toggle:
            off = not off
            self.toggle = False
        if self._distributed():
            flag = torch.tensor([int(off)], dtype=torch.int32, device=device.get_current_device())
            torch.distributed.broadcast(flag, 0)
            off = bool(flag.item())
        if off != self._off:
            self._set_state(off)
            if self.rank == 0:
                logger.info("StragglerDetector toggled %s", "OFF" if off else "ON")

    @property
    def enabled(self) -> bool:
        """Whether spans are being collected."""
        return not self._off

    @property
    def configured(self) -> bool:
        """Whether ``configure`` has run in this process."""
        return StragglerDetector._configured

    @property
    def my_rank(self) -> int:
        """The configured rank."""
        return self.rank

    @property
    def world_size(self) -> int:
        """The configured world size."""
        return self.world

    def null_method(self) -> None:
        """What ``start``/``stop`` do while collection is off."""

    def __enter__(self) -> StragglerDetector:
        self.start()
        return self

    def __call__(self, bdata: bool = False) -> StragglerDetector:
        """Mark the next ``with`` block as data loading (``bdata=True``) or compute."""
        self.bdata = bdata
        return self

    def __exit__(self, ex_type: type[BaseException] | None, ex_val: BaseException | None,
                 ex_tb: TracebackType | None) -> bool:
        if ex_type is not None:
            logger.warning("StragglerDetector: exception inside a timed region: %s", ex_val)
        self.stop()
        return False
