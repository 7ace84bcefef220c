"""Streams and events for activation offloading, on CUDA or (as no-ops) on the host.

On CUDA, offloads run on a device-to-host stream and reloads on a host-to-device stream, ordered by events.
A CPU run offloads into separate host buffers with plain synchronous copies, so its "streams" and "events"
are stand-ins whose waits and records do nothing: the same offload code serves both devices.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["HostEvent", "HostStream", "current_stream", "new_event", "new_stream", "use_stream"]


class HostStream:
    """A stand-in stream for host (CPU) work, which runs in program order: waits and records do nothing."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for: host copies are synchronous."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for: host copies are synchronous."""

    def record_event(self, event: Any = None) -> Any:
        """Return ``event`` unchanged (there is nothing to record)."""
        return event


class HostEvent:
    """A stand-in event for host (CPU) work: always complete."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record: host copies are synchronous."""

    def query(self) -> bool:
        """Always True: the work before it has finished."""
        return True


def new_stream(device_type: str) -> Any:
    """A new side stream for ``device_type`` (``"cuda"``: a CUDA stream; otherwise a :class:`HostStream`)."""
    return torch.cuda.Stream() if device_type == "cuda" else HostStream()


def new_event(device_type: str) -> Any:
    """A new event for ``device_type`` (``"cuda"``: a CUDA event; otherwise a :class:`HostEvent`)."""
    return torch.cuda.Event() if device_type == "cuda" else HostEvent()


def current_stream(device_type: str) -> Any:
    """The stream the compute runs on (a :class:`HostStream` off CUDA)."""
    return torch.cuda.current_stream() if device_type == "cuda" else HostStream()


def use_stream(stream: Any) -> contextlib.AbstractContextManager:
    """Context that issues work on ``stream`` (nothing to switch for a :class:`HostStream`)."""
    if isinstance(stream, HostStream):
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)
