"""The server's bound on work in flight (no web framework needed here).

Every generation, streaming or not, takes one slot per prompt from :meth:`Admission.acquire`
before it reaches the engine and gives it back when its response has ended (finished, failed,
cancelled, or the client went away). Beyond ``limit`` slots the server answers 429; once
shutdown has begun, 503.
"""

from __future__ import annotations

from megatron_core.inference.text_generation_server.protocol import APIError

__all__ = ["Admission", "Ticket"]


class Ticket:
    """Slots held by one HTTP request; :meth:`release` (idempotent) gives them back."""

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission, self.count = admission, count
        self.request_ids: list[int] = []

    def track(self, request_id: int) -> None:
        """Record an engine request of this HTTP request (shutdown cancels what is still running)."""
        self.request_ids.append(request_id)
        self._admission.in_flight.add(request_id)

    def release(self) -> None:
        """Give the slots back and forget the engine requests."""
        if self._admission is None:
            return
        self._admission.used -= self.count
        self._admission.in_flight.difference_update(self.request_ids)
        self._admission = None


class Admission:
    """Counts the slots in use; refuses beyond ``limit`` or while draining."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.in_flight: set[int] = set()  # engine request ids of the admitted requests
        self.draining = False

    def acquire(self, count: int) -> Ticket:
        """``count`` slots, or an :class:`APIError` (503 while draining, 429 when full)."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.used + count > self.limit:
            raise APIError(429, f"the server is at capacity ({self.used} requests in flight, limit "
                                f"{self.limit}); retry later")
        self.used += count
        return Ticket(self, count)
