"""What the engine does when serving fails (a mixin of ``DynamicInferenceEngine``).

Three depths, so that no caller ever waits for a request that will not finish:

* **One request.** An exception raised while booking one request's token (stop words, log-probs,
  a token listener) fails that request alone: it finishes as ``FAILED`` with ``request.error``
  saying why, its future resolves and its KV blocks are freed.
* **One step.** An exception raised by a step's forward or sampling cannot be pinned on a row. If
  the step held one request, that request fails. Otherwise every request of the step is *isolated*:
  its KV blocks are freed and it goes back to the front of the queue (as in an eviction: it is
  re-prefilled with its prompt and the tokens generated so far, so greedy outputs are unchanged),
  and each then runs in steps of its own until it has sampled a token. A request that fails again
  on its own fails alone; the others carry on.
* **The loop.** An exception that escapes the step itself (or the recovery) stops the loop:
  :attr:`failure` records it, it is logged with its traceback, every pending request fails at
  once, and later :meth:`add_request` calls raise :class:`EngineFailedError`.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from megatron_core.inference.inference_request import ENDED_STATUSES, DynamicInferenceRequest, Status

__all__ = ["CANCELLED", "EngineFailedError", "FaultIsolation", "RequestRejectedError"]

logger = logging.getLogger(__name__)

CANCELLED = "cancelled"  # ``request.error`` of a request stopped by ``cancel_request``


class EngineFailedError(RuntimeError):
    """The engine loop has stopped after an error; no request can be served any more."""


class RequestRejectedError(ValueError):
    """A request the engine refuses in ``add_request``; ``param`` names the offending setting
    (``"prompt"`` or a :class:`SamplingParams` field)."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def describe(error: BaseException) -> str:
    """``"TypeName: message"``."""
    return f"{type(error).__name__}: {error}"


class FaultIsolation:
    """Mixin over the engine's ``requests``, ``running``, ``waiting``, ``paused_request_ids``,
    ``context``, ``_inbox``, ``_inbox_lock`` and ``_finish``."""

    failure: BaseException | None = None  # why the loop stopped, if it did
    failure_traceback: str | None = None
    failed_request_count: int = 0  # requests failed by an error (not by a cancel)
    isolated_request_count: int = 0  # requests sent to run on their own after a step failed

    def _init_fault_isolation(self) -> None:
        self._suspects: set[Any] = set()

    def _fail_request(self, request: DynamicInferenceRequest, message: str) -> None:
        """Take ``request`` out of every queue, free its blocks, finish it as ``FAILED``."""
        request_id = request.request_id
        if request.status in ENDED_STATUSES:
            return
        if request_id in self.running:
            self.running.remove(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        if request_id in self.paused_request_ids:
            self.paused_request_ids.remove(request_id)
        self._suspects.discard(request_id)
        self.context.release_request(request_id)
        self.failed_request_count += 1
        self._finish(request, Status.FAILED, error=message)

    def _isolate(self, request_ids: list[Any]) -> None:
        """Free the blocks of ``request_ids`` and queue them at the front, each to run on its own."""
        for request_id in reversed(request_ids):
            request = self.requests[request_id]
            if request_id in self.running:
                self.running.remove(request_id)
            if request_id in self.paused_request_ids:
                self.paused_request_ids.remove(request_id)
            self.context.release_request(request_id)
            request.add_event_evict()
            request.status = Status.WAITING_IN_QUEUE
            if request_id not in self.waiting:
                self.waiting.appendleft(request_id)
            self._suspects.add(request_id)
            self.isolated_request_count += 1

    def _recover_from_step_error(self, error: Exception, involved: list[Any]) -> None:
        """A step raised ``error``: fail its one request, or isolate its requests (see the module doc)."""
        self._inflight = None  # its tokens are lost: its requests are failed or re-prefilled below
        live = [rid for rid in dict.fromkeys(involved) if self._is_live(rid)]
        if not live:  # the step failed before it held anyone: suspect every running request
            live = [rid for rid in self.running if self._is_live(rid)]
        logger.error("inference step failed for request(s) %s", live, exc_info=error)
        if len(live) == 1:
            self._fail_request(self.requests[live[0]], f"internal error while generating: {describe(error)}")
        elif live:
            self._isolate(live)

    def _schedule_isolated(self) -> list | None:
        """The step of the one isolated request that may run now, or ``None`` to schedule as usual."""
        ctx = self.context
        running = next((rid for rid in self.running if rid in self._suspects), None)
        if running is not None:
            request = self.requests[running]
            kv = ctx.kv_length(running)
            n = min(self._sequence_length(request) - kv, ctx.max_tokens, self._room(running))
            if n <= 0:
                return None
            ctx.grow_request(running, kv + n)
            return [self._entry(request, kv, n)]
        if not self.waiting or self.waiting[0] not in self._suspects or ctx.total_request_count >= ctx.max_requests:
            return None
        request = self.requests[self.waiting[0]]
        n = min(self._sequence_length(request), ctx.max_tokens,
                ctx.block_allocator.get_active_avail() * ctx.block_size_tokens)
        if n <= 0:
            return None
        self.waiting.popleft()
        ctx.add_request(request.request_id)
        ctx.grow_request(request.request_id, n)
        self.running.append(request.request_id)
        request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
        return [self._entry(request, 0, n)]

    def _fail_engine(self, error: BaseException) -> None:
        """The loop is stopping because of ``error``: record and log it, fail every pending request."""
        with self._inbox_lock:
            self.failure = error
            self.failure_traceback = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            inbox, self._inbox = self._inbox, []
        logger.error("the inference engine loop stopped: %s\n%s", describe(error), self.failure_traceback)
        for request in inbox:
            self.requests.setdefault(request.request_id, request)
        message = f"the inference engine stopped after an error: {describe(error)}"
        for request in list(self.requests.values()):
            if request.status not in ENDED_STATUSES:
                try:
                    self._fail_request(request, message)
                except Exception:  # noqa: BLE001 - keep failing the others; the future must resolve
                    self._resolve_future(request)

    def _resolve_future(self, request: DynamicInferenceRequest) -> None:
        """Last resort when finishing ``request`` raised: mark it failed and resolve its future and listeners."""
        request.status = Status.FAILED
        request.error = request.error or "internal error"
        with self._inbox_lock:
            future = self.futures.pop(request.request_id, None)
            listeners = self.listeners.pop(request.request_id, [])
        for listener in listeners:
            try:
                listener(request, None)
            except Exception:  # noqa: BLE001
                pass
        if future is not None and not future.done():
            future.set_result(request)
