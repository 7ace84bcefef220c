"""Asynchronous checkpoint saving (Megatron-Core ``AsyncRequest`` / ``AsyncCallsQueue``).

``save(..., async_sharded_save=True)`` plans the save (small collectives) and stages every
tensor into a private CPU copy on the caller's thread, then returns an :class:`AsyncRequest`
whose ``async_fn`` only writes files, with no collectives, so it can run in a background thread
(an :class:`AsyncCaller`: a :class:`TemporalAsyncCaller` per request, or one :class:`PersistentAsyncCaller`)
while training goes on. Its ``finalize_fns`` (gathering write results, DCP ``.metadata``,
``metadata.json``, renaming the directory into place) run on the caller's thread from
:meth:`AsyncCallsQueue.maybe_finalize_async_calls`, which every rank must call at the same
points: a call is finalized only once every rank has finished writing it.

Megatron runs the writer in a separate process; a thread suffices here because file writes and
``torch.save`` of large tensors release the GIL. As Megatron-Core's persistent writer process does, the
persistent writer thread lowers its own priority first on Linux (:func:`_set_process_qos`, nice 10 by
default: there the thread's alone; elsewhere it would be the whole process's, so it is left alone).
Megatron-Core's writer also runs with the garbage collector off (:func:`_disable_gc`); ours does not, since
the collector is shared with the training thread here and switching it off would switch it off for
training too.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.strategies._writer_qos import (
    _disable_gc,  # noqa: F401 - 0.19's path
    _set_process_qos,
    check_qos,
)

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


class AsyncCaller(ABC):
    """Runs the background part of :class:`AsyncRequest`s and tells, across ranks, when one is done.

    A write that raises is logged and kept (see :attr:`error`) instead of propagating.
    """

    @property
    @abstractmethod
    def error(self) -> BaseException | None:
        """This rank's failure of the current call, if it failed."""

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start ``async_req.async_fn`` (and ``preload_fn`` first, on this thread) in the background."""

    @abstractmethod
    def _current_call_alive(self, blocking: bool) -> bool:
        """Whether the current call still runs on this rank (after waiting for it when ``blocking``)."""

    @abstractmethod
    def _retire_current_call(self) -> None:
        """Forget the current (finished) call; the next scheduled one becomes current."""

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """True once the current call has finished on every rank (on this rank only with ``no_dist``).

        Collective unless ``no_dist``; with ``blocking`` it waits. :attr:`error` then holds this rank's
        failure of that call, if any.
        """
        alive = self._current_call_alive(blocking)
        return not alive if no_dist else self.sync_all_async_calls(int(alive))

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank reports its current call alive (collective)."""
        return not collectives.any_rank_true(bool(is_alive))

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Wait for (``abort``: stop waiting for) the scheduled calls and release the worker."""


def _run(call_idx: int, request: AsyncRequest, errors: dict[int, BaseException]) -> None:
    try:
        if request.async_fn is not None:
            request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to every rank at finalize time
        logger.exception("asynchronous checkpoint write %d failed", call_idx)
        errors[call_idx] = e


class TemporalAsyncCaller(AsyncCaller):
    """A new background thread for one request (Megatron-Core forks a process instead)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.call_idx = 0
        self._errors: dict[int, BaseException] = {}

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Run ``preload_fn`` here, then ``async_fn`` in a fresh thread."""
        if async_req.preload_fn is not None:
            async_req.preload_fn()
        self.call_idx = async_req.call_idx
        self.thread = threading.Thread(target=_run, args=(async_req.call_idx, async_req, self._errors),
                                       name=f"mcore-ckpt-write-{async_req.call_idx}", daemon=True)
        self.thread.start()

    @property
    def error(self) -> BaseException | None:
        """The failure of this caller's call, if it failed."""
        return self._errors.get(self.call_idx)

    def _current_call_alive(self, blocking: bool) -> bool:
        if blocking and self.thread is not None:
            self.thread.join()
        return self.thread is not None and self.thread.is_alive()

    def _retire_current_call(self) -> None:
        self.close()

    def close(self, abort: bool = False) -> None:
        """Wait for the thread unless ``abort`` (a thread cannot be killed: it is left to finish alone)."""
        if self.thread is not None and not abort:
            self.thread.join()
        self.thread = None


class PersistentAsyncCaller(AsyncCaller):
    """One background thread that runs every scheduled request in order (Megatron-Core: one worker process).

    Args:
        cpu_priority: nice value the worker thread takes when it starts (0-19; None keeps training's);
            Megatron-Core's default, 10.
        io_priority: ``ionice`` class the worker thread takes (0-3, 3 idle; None keeps it), as Megatron-Core.
    """

    def __init__(self, cpu_priority: int | None = 10, io_priority: int | None = None) -> None:
        check_qos(cpu_priority, io_priority)
        self.cpu_priority = cpu_priority
        self.io_priority = io_priority
        self._work: queue.Queue[tuple[int, AsyncRequest, threading.Event] | None] = queue.Queue()
        self._pending: list[tuple[int, threading.Event]] = []
        self._errors: dict[int, BaseException] = {}
        self._worker: threading.Thread | None = None

    def _serve(self) -> None:
        if sys.platform.startswith("linux"):  # elsewhere nice / ionice would act on the whole training process
            _set_process_qos(cpu_priority=self.cpu_priority, io_priority=self.io_priority)
        while True:
            item = self._work.get()
            if item is None:
                return
            call_idx, request, done = item
            _run(call_idx, request, self._errors)
            done.set()

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Run ``preload_fn`` here, then queue ``async_fn`` for the worker thread (started on first use)."""
        if async_req.preload_fn is not None:
            async_req.preload_fn()
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name="mcore-ckpt-writer", daemon=True)
            self._worker.start()
        done = threading.Event()
        self._pending.append((async_req.call_idx, done))
        self._work.put((async_req.call_idx, async_req, done))

    @property
    def error(self) -> BaseException | None:
        """The failure of the current (oldest unretired) call, if it failed."""
        return self._errors.get(self._pending[0][0]) if self._pending else None

    def _current_call_alive(self, blocking: bool) -> bool:
        if not self._pending:
            return False
        if blocking:
            self._pending[0][1].wait()
        return not self._pending[0][1].is_set()

    def _retire_current_call(self) -> None:
        if self._pending:
            self._errors.pop(self._pending.pop(0)[0], None)

    def close(self, abort: bool = False) -> None:
        """Stop the worker after the queued calls (``abort``: without waiting for them)."""
        if self._worker is not None:
            self._work.put(None)
            if not abort:
                self._worker.join()
            self._worker = None
        self._pending = []


class AsyncCallsQueue:
    """Runs scheduled :class:`AsyncRequest` writes in the background and finalizes them in order.

    ``persistent=True`` keeps one :class:`PersistentAsyncCaller` (one worker thread, requests in order)
    for all requests; otherwise each request gets a :class:`TemporalAsyncCaller` (a thread of its own).
    """

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self.async_calls: list[tuple[int, AsyncCaller, AsyncRequest]] = []
        self.call_idx = -1
        self._persistent_caller: PersistentAsyncCaller | None = None

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller()
        if self._persistent_caller is None:
            self._persistent_caller = PersistentAsyncCaller()
        return self._persistent_caller

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start the background part of ``async_request``; returns its call index."""
        self.call_idx += 1
        request = replace(async_request.freeze(), call_idx=self.call_idx)
        caller = self._get_async_caller()
        caller.schedule_async_call(request)
        self.async_calls.append((self.call_idx, caller, request))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the oldest calls that every rank has finished; returns their indices.

        With ``blocking`` it waits for all scheduled calls. Collective unless ``no_dist``: all
        ranks must call it together. A write that failed on any rank raises
        ``CheckpointingException`` on every rank and its finalize functions do not run, so the
        checkpoint never becomes visible.
        """
        finished = []
        while self.async_calls:
            call_idx, caller, request = self.async_calls[0]
            if not caller.is_current_async_call_done(blocking, no_dist):
                break
            error = caller.error
            failed = error is not None if no_dist else collectives.any_rank_true(error is not None)
            self.async_calls.pop(0)
            caller._retire_current_call()
            if failed:
                reason = f"{type(error).__name__}: {error}" if error else "it failed on another rank"
                raise CheckpointingException(f"asynchronous checkpoint save {call_idx} failed: {reason}")
            for fn in request.finalize_fns:
                fn()
            finished.append(call_idx)
        return finished

    def get_num_unfinalized_calls(self) -> int:
        """How many scheduled calls are not finalized yet."""
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize everything still scheduled (collective; skipped with ``abort``) and stop the worker."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
        if self._persistent_caller is not None:
            self._persistent_caller.close(abort=abort)
            self._persistent_caller = None
