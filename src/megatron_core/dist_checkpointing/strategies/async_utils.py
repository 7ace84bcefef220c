"""Asynchronous checkpoint saving (Megatron-Core ``AsyncRequest`` / ``AsyncCallsQueue``).

``save(..., async_sharded_save=True)`` plans the save (small collectives) and stages every
tensor into a private CPU copy on the caller's thread, then returns an :class:`AsyncRequest`
whose ``async_fn`` only writes files, with no collectives, so it can run in a background thread
while training goes on. Its ``finalize_fns`` (gathering write results, DCP ``.metadata``,
``metadata.json``, renaming the directory into place) run on the caller's thread from
:meth:`AsyncCallsQueue.maybe_finalize_async_calls`, which every rank must call at the same
points: a call is finalized only once every rank has finished writing it.

Megatron runs the writer in a separate process; a thread suffices here because file writes and
``torch.save`` of large tensors release the GIL.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncRequest:
    """A save split into a background part (``async_fn``) and foreground ``finalize_fns``."""

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple
    finalize_fns: list[Callable[[], None]]
    async_fn_kwargs: dict = field(default_factory=dict)
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0
    # File name -> (sha256, size) of every file the save wrote, filled on rank 0 when the write finishes.
    file_digests: dict = field(default_factory=dict)

    def add_finalize_fn(self, fn: Callable[[], None]) -> None:
        """Append a function to run after the background part finished on every rank."""
        if self.is_frozen:
            raise CheckpointingException("cannot add a finalize function to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Run the whole request on this thread (what a synchronous save does)."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> AsyncRequest:
        """A copy that accepts no more finalize functions."""
        return replace(self, is_frozen=True)


class _Call:
    """One scheduled request: its background work and the outcome."""

    def __init__(self, idx: int, request: AsyncRequest) -> None:
        self.idx = idx
        self.request = request
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*self.request.async_fn_args, **self.request.async_fn_kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to every rank at finalize time
            logger.exception("asynchronous checkpoint write %d failed", self.idx)
            self.error = e
        finally:
            self.done.set()


class AsyncCallsQueue:
    """Runs scheduled :class:`AsyncRequest` writes in the background and finalizes them in order.

    ``persistent=True`` keeps one worker thread for all requests; otherwise each request gets a
    thread of its own. Either way requests are written one after another.
    """

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self._calls: list[_Call] = []
        self._next_idx = 0
        self._work: queue.Queue[_Call | None] | None = None
        self._worker: threading.Thread | None = None
        self._last_thread: threading.Thread | None = None

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start the background part of ``async_request``; returns its call index."""
        if async_request.preload_fn is not None:
            async_request.preload_fn()
        call = _Call(self._next_idx, async_request.freeze())
        self._next_idx += 1
        self._calls.append(call)
        if self.persistent:
            if self._worker is None:
                self._work = queue.Queue()
                self._worker = threading.Thread(target=self._serve, name="mcore-ckpt-writer", daemon=True)
                self._worker.start()
            self._work.put(call)
        else:
            previous = self._last_thread

            def run_after_previous() -> None:
                if previous is not None:
                    previous.join()
                call.run()

            self._last_thread = threading.Thread(target=run_after_previous, name=f"mcore-ckpt-write-{call.idx}",
                                                 daemon=True)
            self._last_thread.start()
        return call.idx

    def _serve(self) -> None:
        assert self._work is not None
        while True:
            call = self._work.get()
            if call is None:
                return
            call.run()

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the oldest calls that every rank has finished; returns their indices.

        With ``blocking`` it waits for all scheduled calls. Collective unless ``no_dist``: all
        ranks must call it together. A write that failed on any rank raises
        ``CheckpointingException`` on every rank and its finalize functions do not run, so the
        checkpoint never becomes visible.
        """
        finished = []
        while self._calls:
            call = self._calls[0]
            if blocking:
                call.done.wait()
            local_done = call.done.is_set()
            all_done = local_done if no_dist else not collectives.any_rank_true(not local_done)
            if not all_done:
                break
            failed = call.error is not None
            if not no_dist:
                failed = collectives.any_rank_true(failed)
            self._calls.pop(0)
            if failed:
                reason = f"{type(call.error).__name__}: {call.error}" if call.error else "it failed on another rank"
                raise CheckpointingException(f"asynchronous checkpoint save {call.idx} failed: {reason}")
            for fn in call.request.finalize_fns:
                fn()
            finished.append(call.idx)
        return finished

    def get_num_unfinalized_calls(self) -> int:
        """How many scheduled calls are not finalized yet."""
        return len(self._calls)

    def close(self) -> None:
        """Finalize everything still scheduled (collective) and stop the worker thread."""
        self.maybe_finalize_async_calls(blocking=True)
        if self._worker is not None and self._work is not None:
            self._work.put(None)
            self._worker.join()
            self._worker = None
