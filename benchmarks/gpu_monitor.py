"""Sampling the GPUs' clocks, power and temperature with ``nvidia-smi`` while a benchmark runs.

A multi-GPU run that is slower per GPU than the one-GPU baseline may be slowed by the node rather than by
communication: with every GPU busy, a shared power or cooling budget can hold the clocks down. The samples
say which: ``summarize`` gives, per GPU, the median SM clock and power draw over the samples in which the GPU
was busy, the highest temperature, and the clock-limiting reasons NVIDIA's driver reported.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from pathlib import Path
from types import TracebackType

FIELDS = ("index", "utilization.gpu", "clocks.sm", "power.draw", "temperature.gpu")
REASONS_FIELD = "clocks_event_reasons.active"
# NVML's clocks-event (throttle) reason bits.
REASON_BITS = {0x1: "idle", 0x2: "application clocks", 0x4: "software power cap", 0x8: "hardware slowdown",
               0x10: "sync boost", 0x20: "software thermal", 0x40: "hardware thermal", 0x80: "power brake",
               0x100: "display clocks"}
BUSY_PERCENT = 50.0


def reason_names(mask: int) -> list[str]:
    """The names of the bits set in a clocks-event-reasons mask (idle excluded)."""
    return [name for bit, name in REASON_BITS.items() if mask & bit and bit != 0x1]


class GpuMonitor:
    """``with GpuMonitor(path):`` samples every GPU into ``path`` (CSV) every ``interval_ms``; a no-op where
    ``nvidia-smi`` is missing (CPU runs)."""

    def __init__(self, path: Path, interval_ms: int = 500, enabled: bool = True) -> None:
        self.path = path
        self.interval_ms = interval_ms
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.fields: tuple[str, ...] = ()
        self._proc: subprocess.Popen | None = None
        self._handle = None

    def _start(self, fields: tuple[str, ...]) -> subprocess.Popen:
        self._handle = open(self.path, "w")
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                 "-lms", str(self.interval_ms)], stdout=self._handle, stderr=subprocess.DEVNULL)

    def __enter__(self) -> GpuMonitor:
        if not self.enabled:
            return self
        self.fields = (*FIELDS, REASONS_FIELD)
        self._proc = self._start(self.fields)
        time.sleep(0.5)
        if self._proc.poll() not in (None, 0):  # a driver without the reasons field
            self._handle.close()
            self.fields = FIELDS
            self._proc = self._start(self.fields)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._handle.close()
            self._proc = None

    def samples(self) -> list[dict[str, str]]:
        """The samples as dicts keyed by field (lines that do not parse are skipped)."""
        if not self.fields or not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text(errors="replace").splitlines():
            values = [v.strip() for v in line.split(",")]
            if len(values) == len(self.fields):
                rows.append(dict(zip(self.fields, values)))
        return rows

    def summarize(self) -> dict[str, dict]:
        """Per GPU index: busy samples, median SM MHz and W while busy, max temperature, limiting reasons."""
        return summarize_samples(self.samples())


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def summarize_samples(samples: list[dict[str, str]]) -> dict[str, dict]:
    """See :meth:`GpuMonitor.summarize`; GPUs never busy are left out."""
    by_gpu: dict[str, list[dict[str, str]]] = {}
    for sample in samples:
        utilization = _number(sample.get("utilization.gpu", ""))
        if utilization is not None and utilization >= BUSY_PERCENT:
            by_gpu.setdefault(sample["index"], []).append(sample)
    summary = {}
    for index, busy in sorted(by_gpu.items()):
        clocks = [c for c in (_number(s["clocks.sm"]) for s in busy) if c is not None]
        power = [p for p in (_number(s["power.draw"]) for s in busy) if p is not None]
        temperature = [t for t in (_number(s["temperature.gpu"]) for s in busy) if t is not None]
        reasons: set[str] = set()
        for sample in busy:
            mask = sample.get(REASONS_FIELD, "")
            if mask.startswith("0x"):
                reasons.update(reason_names(int(mask, 16)))
        summary[index] = {"busy samples": len(busy),
                          "SM MHz": statistics.median(clocks) if clocks else None,
                          "W": statistics.median(power) if power else None,
                          "max C": max(temperature) if temperature else None,
                          "reasons": sorted(reasons)}
    return summary


def describe(summary: dict[str, dict]) -> str:
    """One line: ``gpu0 1980 MHz 650 W 61 C [software power cap]; ...``."""
    parts = []
    for index, gpu in summary.items():
        mhz, watts, temp = gpu["SM MHz"], gpu["W"], gpu["max C"]
        text = (f"gpu{index} {'-' if mhz is None else f'{mhz:.0f}'} MHz {'-' if watts is None else f'{watts:.0f}'} W "
                f"{'-' if temp is None else f'{temp:.0f}'} C")
        if gpu["reasons"]:
            text += f" [{', '.join(gpu['reasons'])}]"
        parts.append(text)
    return "; ".join(parts)
