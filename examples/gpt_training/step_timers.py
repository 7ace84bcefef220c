"""``--step-time-breakdown``: where a training step's time goes, from CUDA events (no extra synchronisation).

:class:`StepTimers` has the call shape of Megatron-Core's ``timers`` (``timers(name, log_level=...)``
returns an object with ``start()``/``stop()``), so the library's schedules fill it through
``config.timers``: ``forward-backward`` (the whole schedule), ``forward-compute`` and
``backward-compute`` (each micro-batch's forward and backward). The training loop adds
``grads-sync`` (``finalize_model_grads``: the gradient reduction left after backward) and
``optimizer``. Each span is a pair of events on the current stream, read once per log interval for the
steps whose kernels have finished, so the timers never stall the GPU; on CPU they read the wall clock.

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

    def take_ms(self, count: int) -> float:
        """Milliseconds summed over the oldest ``count`` closed spans (their events must have completed);
        removes them."""
        taken, self.spans = self.spans[:count], self.spans[count:]
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in taken)
        return 1000.0 * sum(b - a for a, b in taken)


class StepTimers:
    """Named span timers with the ``timers(name, log_level=...)`` call shape of Megatron's ``Timers``.

    The loop calls :meth:`end_step` after each training step; :meth:`take_finished_steps` then reads the spans
    of the steps whose kernels have all run, without waiting for the ones still queued.
    """

    NAMES = ("forward-backward", "forward-compute", "backward-compute", "grads-sync", "optimizer")

    def __init__(self) -> None:
        self.cuda = device.get_current_device().type == "cuda"
        self._timers: dict[str, _SpanTimer] = {}
        # Per step not yet read: how many spans of each name had closed when it ended, and a marker event queued
        # after its last kernel (None on CPU, where every span is complete when it closes).
        self._steps: list[tuple[dict[str, int], object | None]] = []

    def __call__(self, name: str, log_level: int = 0) -> _SpanTimer:
        """The timer called ``name`` (created on first use; every level is recorded)."""
        if name not in self._timers:
            self._timers[name] = _SpanTimer(self.cuda)
        return self._timers[name]

    def end_step(self) -> None:
        """Close a training step: the spans recorded since the previous call belong to it."""
        marker = None
        if self.cuda:
            marker = torch.cuda.Event()
            marker.record()
        self._steps.append(({name: len(timer.spans) for name, timer in self._timers.items()}, marker))

    def take_finished_steps(self) -> tuple[dict[str, float], int]:
        """``(milliseconds per name, steps)`` over the oldest closed steps whose kernels have all run.

        Does not wait, unless no step has finished yet: then it waits for the oldest one.
        """
        finished = next((i + 1 for i in range(len(self._steps) - 1, -1, -1)
                         if self._steps[i][1] is None or self._steps[i][1].query()), 0)
        if finished == 0 and self._steps:
            self._steps[0][1].synchronize()
            finished = 1
        if finished == 0:
            return {name: 0.0 for name in self.NAMES}, 0
        counts = self._steps[finished - 1][0]
        totals = {name: self(name).take_ms(counts.get(name, 0)) for name in self.NAMES}
        self._steps = [({name: n - counts.get(name, 0) for name, n in later.items()}, marker)
                       for later, marker in self._steps[finished:]]
        return totals, finished

    def discard(self) -> None:
        """Drop the spans recorded since the last :meth:`end_step` (e.g. an evaluation's); keeps the steps'."""
        counts = self._steps[-1][0] if self._steps else {}
        for name, timer in self._timers.items():
            del timer.spans[counts.get(name, 0):]


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


def breakdown(timers: StepTimers, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Per-step milliseconds of each part over the finished steps not read yet, averaged over all ranks, plus
    the bubble fraction and peak memory.

    Every rank must call it at the same iteration (it all-gathers host values over ``group``, a gloo group, so
    that the GPU's queue is not drained; None: the default group, which must then be gloo or of one rank).
    """
    t, steps = timers.take_finished_steps()
    steps = max(steps, 1)
    fwd_bwd = t["forward-backward"] / steps
    compute = (t["forward-compute"] + t["backward-compute"]) / steps
    grads = t["grads-sync"] / steps
    bubble = max(fwd_bwd - compute - grads, 0.0)
    local = torch.tensor(
        [fwd_bwd, compute, grads, t["optimizer"] / steps, bubble, bubble / fwd_bwd if fwd_bwd else 0.0,
         device.max_memory_allocated() / 1e9],
        dtype=torch.float64,
    )
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [torch.zeros_like(local) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, local, group=group)
    else:
        gathered = [local]
    stacked = torch.stack(gathered)
    mean = stacked.mean(dim=0).tolist()
    return {
        "fwd-bwd ms": mean[0], "compute ms": mean[1], "grad-sync ms": mean[2], "optimizer ms": mean[3],
        "bubble ms": mean[4], "bubble %": 100 * mean[5], "max compute ms": float(stacked[:, 1].max()),
        "max mem GB": float(stacked[:, 6].max()),
    }
