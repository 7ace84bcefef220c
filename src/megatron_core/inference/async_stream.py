"""A per-request stream of partial results (Megatron-Core's ``inference.async_stream``).

The static engine gives each request added with ``streaming=True`` an :class:`AsyncStream`. The thread
that generates (often an executor thread of :meth:`StaticInferenceEngine.run_engine_async`) calls
:meth:`AsyncStream.put` with a partial :class:`InferenceRequest` after every step and :meth:`AsyncStream.finish`
at the end; a coroutine on the stream's event loop reads them with ``async for`` over
:meth:`AsyncStream.generator`. Items cross threads through ``loop.call_soon_threadsafe``, so the stream is
bound to one event loop: the running loop when it is built (else the process-wide loop of
:func:`megatron_core.utils.get_asyncio_loop`, as in Megatron-Core). Unlike Megatron-Core, reading a stream from
another loop, or putting to one whose loop is closed, raises a ``RuntimeError`` naming the request instead of
hanging, and a reader that stops early (``aclose``, cancellation) cancels the stream and gets its own
``GeneratorExit`` / ``CancelledError`` back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from megatron_core._ground.async_utils import get_asyncio_loop
from megatron_core.inference.inference_request import InferenceRequest

__all__ = ["STOP_ITERATION", "AsyncStream"]

STOP_ITERATION = Exception()
"""The sentinel :meth:`AsyncStream.finish` queues to end a stream normally."""


class AsyncStream:
    """Partial results of one request, read as an async generator on the stream's event loop.

    Args:
        request_id: the request this stream belongs to (used in error messages).
        cancel: called with no arguments when the reader stops before the stream ends.
        loop: the event loop that reads the stream; default: the running loop, else the process-wide one.
    """

    def __init__(
        self, request_id: Any, cancel: Callable[[], None], loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._request_id = request_id
        self._cancel = cancel
        self._loop = get_asyncio_loop(loop)
        if self._loop.is_closed():
            raise RuntimeError(f"cannot stream request {request_id!r}: its event loop is closed; add the request "
                               "with streaming=True from inside the event loop that will read the stream")
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finished = False

    @property
    def request_id(self) -> Any:
        """The request this stream belongs to."""
        return self._request_id

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the stream delivers to."""
        return self._loop

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` was called (later :meth:`put` calls are dropped)."""
        return self._finished

    def put(self, item: InferenceRequest | BaseException) -> None:
        """Queue ``item`` for the reader (from any thread); dropped once the stream is finished."""
        if self._finished:
            return
        if self._loop.is_closed():
            raise RuntimeError(f"cannot stream request {self._request_id!r}: its event loop was closed before the "
                               "request finished; read the stream inside the loop that added the request")
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def finish(self, exception: BaseException | type[BaseException] | None = None) -> None:
        """End the stream (from any thread): the reader stops, or raises ``exception`` when one is given.

        Idempotent; a stream whose loop is already closed (nobody can read it) is just marked finished.
        """
        if self._finished:
            return
        self._finished = True
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(
            self._queue.put_nowait, exception if self._is_raisable(exception) else STOP_ITERATION)

    async def generator(self) -> AsyncGenerator[InferenceRequest, None]:
        """Yield the queued items until the stream finishes (an exception given to :meth:`finish` is raised)."""
        running = asyncio.get_running_loop()
        if running is not self._loop:
            raise RuntimeError(f"the stream of request {self._request_id!r} belongs to another event loop; add the "
                               "request with streaming=True from inside the loop that reads its stream")
        try:
            while True:
                item = await self._queue.get()
                if self._is_raisable(item):
                    if item is STOP_ITERATION:
                        return
                    raise item
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            self._cancel()
            raise

    @staticmethod
    def _is_raisable(value: Any) -> bool:
        """Whether ``value`` is an exception instance or class."""
        return isinstance(value, BaseException) or (isinstance(value, type) and issubclass(value, BaseException))
