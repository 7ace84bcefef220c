"""``--step-time-breakdown``: where a training step's time goes, from CUDA events (no extra synchronisation).

:class:`StepTimers` has the call shape of Megatron-Core's ``timers`` (``timers(name, log_level=...)``
returns an object with ``start()``/``stop()``), so the library's schedules fill it through
``config.timers``: ``forward-backward`` (the whole schedule), ``forward-compute`` and
``backward-compute`` (each micro-batch's forward and backward). The training loop adds
``grads-sync`` (``finalize_model_grads``: the gradient reduction left after backward) and
``optimizer``. Each span is a pair of events on the current stream, read once per log interval,
so the timers never stall the GPU; on CPU they read the wall clock.

Derived per rank, then averaged over ranks (:func:`breakdown`):

* ``compute`` = forward-compute + backward-compute (collectives issued inline by tensor, context and
  expert parallelism run on the compute stream's critical path and are counted here);
* ``bubble`` = forward-backward - compute - grads-sync: pipeline fill/drain and waits for
  activations from neighbouring stages (without pipelining: host gaps and data loading);
* ``grad-sync`` = the data-parallel gradient reduction not hidden behind backward.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_core import device


class _SpanTimer:
    """Start/stop spans of one name, recorded as CUDA event pairs (or wall-clock pairs on CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: list[tuple[object, object]] = []
        self._start: object | None = None

    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, barrier: bool = False) -> None:
        """Open a span (``barrier`` is accepted for Megatron compatibility and ignored)."""
        self._start = self._mark()

    def stop(self, barrier: bool = False) -> None:
        """Close the open span."""
        if self._start is not None:
            self.spans.append((self._start, self._mark()))
            self._start = None

    def total_ms(self) -> float:
        """Milliseconds summed over the closed spans (the device must be synchronised first); clears them."""
        if self.cuda:
            total = sum(a.elapsed_time(b) for a, b in self.spans)
        else:
            total = 1000.0 * sum(b - a for a, b in self.spans)
        self.spans.clear()
        return total


class StepTimers:
    """Named span timers with the ``timers(name, log_level=...)`` call shape of Megatron's ``Timers``."""

    NAMES = ("forward-backward", "forward-compute", "backward-compute", "grads-sync", "optimizer")

    def __init__(self) -> None:
        self.cuda = device.get_current_device().type == "cuda"
        self._timers: dict[str, _SpanTimer] = {}

    def __call__(self, name: str, log_level: int = 0) -> _SpanTimer:
        """The timer called ``name`` (created on first use; every level is recorded)."""
        if name not in self._timers:
            self._timers[name] = _SpanTimer(self.cuda)
        return self._timers[name]

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per name since the last call (synchronises the device once); clears the spans."""
        device.synchronize()
        return {name: self(name).total_ms() for name in self.NAMES}

    def discard(self) -> None:
        """Drop every recorded span (e.g. after an evaluation)."""
        self.totals_ms()


def timed(timers: StepTimers, name: str, func):
    """``func`` wrapped so that each call is one span of ``timers(name)``."""

    def wrapper(*args, **kwargs):
        timer = timers(name)
        timer.start()
        try:
            return func(*args, **kwargs)
        finally:
            timer.stop()

    return wrapper


def breakdown(timers: StepTimers, steps: int) -> dict[str, float]:
    """Per-step milliseconds of each part, averaged over all ranks, plus the bubble fraction and peak memory.

    Every rank must call it at the same iteration (it all-gathers).
    """
    t = timers.totals_ms()
    fwd_bwd = t["forward-backward"] / steps
    compute = (t["forward-compute"] + t["backward-compute"]) / steps
    grads = t["grads-sync"] / steps
    bubble = max(fwd_bwd - compute - grads, 0.0)
    local = torch.tensor(
        [fwd_bwd, compute, grads, t["optimizer"] / steps, bubble, bubble / fwd_bwd if fwd_bwd else 0.0,
         device.max_memory_allocated() / 1e9],
        dtype=torch.float64, device=device.get_current_device(),
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered = [torch.zeros_like(local) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, local)
    else:
        gathered = [local]
    stacked = torch.stack(gathered).cpu()
    mean = stacked.mean(dim=0).tolist()
    return {
        "fwd-bwd ms": mean[0], "compute ms": mean[1], "grad-sync ms": mean[2], "optimizer ms": mean[3],
        "bubble ms": mean[4], "bubble %": 100 * mean[5], "max compute ms": float(stacked[:, 1].max()),
        "max mem GB": float(stacked[:, 6].max()),
    }
