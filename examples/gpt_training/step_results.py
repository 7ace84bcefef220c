"""Each training step's loss, gradient norm and outcome, left on the device until a log line needs them.

Reading a device value on the host waits for every kernel queued before it. A loop that reads the loss
and the gradient norm after each step therefore lets the GPU run dry at the end of every step: the host
then queues the next step's first kernels while the GPU idles. :meth:`~megatron_core.optimizer.
MegatronOptimizer.step_on_device` returns those values unread; the loop queues them here and reads them
all in one transfer when it writes a log line, saves a checkpoint or stops (:meth:`StepResults.settle`).

Reading them at a log line must not drain the GPU either: the values are known before the optimizer's
update is queued, so the loop copies them to pinned host memory right then (:class:`HostCopy`, through
``step_on_device``'s ``outcome_known``) and the log line waits for that copy alone, while the GPU still runs
the update and the host queues the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["HostCopy", "QueuedStep", "SettledStep", "StepResults", "window_summary"]


class HostCopy:
    """Values (0-dim tensors of one device, or numbers) copied to the host in stream order, read later.

    On CUDA the copy goes to pinned memory without blocking the host, followed by an event: :meth:`values`
    waits for the kernels queued before the copy, not for those queued after it.
    """

    def __init__(self, values: list[torch.Tensor | float | None]) -> None:
        tensors = [value for value in values if isinstance(value, torch.Tensor)]
        if len({tensor.device for tensor in tensors}) > 1:
            raise ValueError(f"HostCopy needs tensors of one device, got {sorted({str(t.device) for t in tensors})}")
        self._values = values
        self._host: torch.Tensor | None = None
        self._event = None
        if tensors:
            stacked = torch.stack([tensor.detach().reshape(()).to(torch.float64) for tensor in tensors])
            if stacked.device.type == "cuda":
                self._host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
                self._host.copy_(stacked, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._host = stacked.cpu()

    def values(self) -> list[float | None]:
        """The values as floats (None stays None), in the order given (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        read = iter(self._host.tolist() if self._host is not None else [])
        return [next(read) if isinstance(value, torch.Tensor) else None if value is None else float(value)
                for value in self._values]


@dataclass
class QueuedStep:
    """One step's results as the optimizer returned them: 0-dim device tensors, or host values it had read."""

    iteration: int
    loss: torch.Tensor | float
    update_successful: torch.Tensor | bool
    grad_norm: torch.Tensor | float | None
    scheduler_advanced: bool  # the loop advanced the learning-rate schedule before the outcome was known
    extra: dict[str, torch.Tensor | float] = field(default_factory=dict)  # logged with the step (MoE metrics)
    # [loss, update_successful, grad_norm, *extra.values()] already on their way to the host, when the loop could
    # start the copy before the optimizer's update was queued (None: read the tensors above at settle time).
    host_copy: HostCopy | None = None


@dataclass
class SettledStep:
    """One step's results read on the host."""

    iteration: int
    loss: float
    update_successful: bool
    grad_norm: float | None
    scheduler_advanced: bool
    extra: dict[str, float]


class StepResults:
    """The steps queued since the last :meth:`settle`, in order."""

    def __init__(self) -> None:
        self._queued: list[QueuedStep] = []

    def add(self, step: QueuedStep) -> None:
        """Queue a step's results (nothing is read)."""
        self._queued.append(step)

    def settle(self) -> list[SettledStep]:
        """Every queued step read on the host, oldest first; the queue empties.

        Steps with a :class:`HostCopy` wait for it alone; the others are read with one device-to-host transfer.
        """
        queued, self._queued = self._queued, []
        fields = [[step.loss, step.update_successful, step.grad_norm, *step.extra.values()] for step in queued]
        tensors = [value for step, values in zip(queued, fields) if step.host_copy is None
                   for value in values if isinstance(value, torch.Tensor)]
        read = iter(_read(tensors))
        settled = []
        for step, values in zip(queued, fields):
            if step.host_copy is not None:
                loss, success, norm, *extra = step.host_copy.values()
            else:
                loss, success, norm, *extra = (next(read) if isinstance(v, torch.Tensor) else v for v in values)
            settled.append(SettledStep(step.iteration, float(loss), bool(success),
                                       None if norm is None else float(norm), step.scheduler_advanced,
                                       {name: float(value) for name, value in zip(step.extra, extra)}))
        return settled


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """The values of 0-dim tensors (any devices), gathered per device and copied to the host once per device."""
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    values = [0.0] * len(tensors)
    for indices in by_device.values():
        stacked = torch.stack([tensors[i].detach().reshape(()).to(torch.float64) for i in indices]).tolist()
        for i, value in zip(indices, stacked):
            values[i] = value
    return values


def window_summary(steps: list[SettledStep]) -> dict[str, float]:
    """A log line's training values over the steps since the previous one, as Megatron-LM's log line gives them.

    The loss and the per-step metrics (MoE) are averaged over the steps that updated the weights (all steps'
    values when none did); the gradient norm is the last step's; ``skipped steps`` counts the others.
    """
    if not steps:
        raise ValueError("a log line needs at least one settled step")
    counted = [step for step in steps if step.update_successful] or steps
    last = steps[-1]
    summary = {
        "lm loss": sum(step.loss for step in counted) / len(counted),
        "grad norm": last.grad_norm if last.grad_norm is not None else float("nan"),
    }
    for name in last.extra:
        values = [step.extra[name] for step in counted if name in step.extra]
        summary[name] = sum(values) / len(values) if values else float("nan")
    summary["skipped steps"] = sum(not step.update_successful for step in steps)
    return summary
