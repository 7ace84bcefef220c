"""Asynchronous checkpoint saving (Megatron-Core ``AsyncRequest`` / ``AsyncCallsQueue``).

``save(..., async_sharded_save=True)`` plans the save (small collectives) and stages every
tensor into a private CPU copy on the caller's thread, then returns an :class:`AsyncRequest`
whose ``async_fn`` only writes files, with no collectives, so it can run in a background thread
(an :class:`AsyncCaller`: a :class:`TemporalAsyncCaller` per request, or one :class:`PersistentAsyncCaller`)
while training goes on. Its ``finalize_fns`` (gathering write results, DCP ``.metadata``,
``metadata.json``, renaming the directory into place) run on the caller's thread from
:meth:`AsyncCallsQueue.maybe_finalize_async_calls`, which every rank must call at the same
points: a call is finalized only once every rank has finished writing it.

As in Megatron-Core 0.19, there is one persistent writer per process, shared by every
``AsyncCallsQueue(persistent=True)``; :meth:`AsyncCallsQueue.warmup_persistent_caller` starts it, with
its priorities, ahead of the first save.

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
import multiprocessing
import queue
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.strategies._writer_qos import (
    _disable_gc,  # noqa: F401 - 0.19's path
    _set_process_qos,
    check_qos,
)

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 60  # how long warmup waits for the writer to take its priorities (ionice may take a while)


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


@dataclass(eq=False)
class _QueuedCall:
    """One request queued on a :class:`PersistentAsyncCaller`: set ``done`` once written, ``error`` if it failed."""

    call_idx: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


_WorkQueue = queue.Queue[tuple[AsyncRequest, _QueuedCall] | None]  # None: stop


class PersistentAsyncCaller(AsyncCaller):
    """One background thread that runs every scheduled request in order (Megatron-Core: one worker process).

    The thread starts with the first request, or earlier with :meth:`start`
    (:meth:`AsyncCallsQueue.warmup_persistent_caller`).

    Args:
        cpu_priority: nice value the worker thread takes when it starts (0-19; None keeps training's);
            Megatron-Core's default, 10.
        io_priority: ``ionice`` class the worker thread takes (0-3, 3 idle; None keeps it), as Megatron-Core.
    """

    def __init__(self, cpu_priority: int | None = 10, io_priority: int | None = None) -> None:
        check_qos(cpu_priority, io_priority)
        self.cpu_priority = cpu_priority
        self.io_priority = io_priority
        self._lock = threading.Lock()
        self._work: _WorkQueue | None = None
        self._ready = threading.Event()
        self._worker: threading.Thread | None = None
        self._pending: list[_QueuedCall] = []

    def _serve(self, work: _WorkQueue, ready: threading.Event) -> None:
        try:
            if sys.platform.startswith("linux"):  # elsewhere nice / ionice would act on the whole training process
                _set_process_qos(cpu_priority=self.cpu_priority, io_priority=self.io_priority)
        finally:
            ready.set()
        while True:
            item = work.get()
            if item is None:
                return
            request, call = item
            errors: dict[int, BaseException] = {}
            _run(call.call_idx, request, errors)
            call.error = errors.get(call.call_idx)
            call.done.set()

    def _ensure_worker(self) -> tuple[threading.Thread, _WorkQueue, threading.Event]:
        """The worker thread, its work queue and its ready flag, starting one (with a queue of its own) if none runs."""
        with self._lock:
            if self._worker is None or self._work is None:
                self._work, self._ready = queue.Queue(), threading.Event()
                self._worker = threading.Thread(target=self._serve, args=(self._work, self._ready),
                                                name="mcore-ckpt-writer", daemon=True)
                self._worker.start()
            return self._worker, self._work, self._ready

    def start(self, wait: bool = False) -> threading.Thread:
        """Start the worker thread now unless it runs; ``wait``: until it has taken its priorities. Returns it."""
        worker, _, ready = self._ensure_worker()
        if wait and not ready.wait(_READY_TIMEOUT_S):
            logger.warning("persistent checkpoint writer took over %d s to set its priorities", _READY_TIMEOUT_S)
        return worker

    def _submit(self, async_req: AsyncRequest) -> _QueuedCall:
        """Run ``preload_fn`` here and queue ``async_fn`` for the worker; the queued call to wait on."""
        if async_req.preload_fn is not None:
            async_req.preload_fn()
        call = _QueuedCall(async_req.call_idx)
        self._ensure_worker()[1].put((async_req, call))
        return call

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Run ``preload_fn`` here, then queue ``async_fn`` for the worker thread (started on first use)."""
        self._pending.append(self._submit(async_req))

    @property
    def error(self) -> BaseException | None:
        """The failure of the current (oldest unretired) call, if it failed."""
        return self._pending[0].error if self._pending else None

    def _current_call_alive(self, blocking: bool) -> bool:
        if not self._pending:
            return False
        if blocking:
            self._pending[0].done.wait()
        return not self._pending[0].done.is_set()

    def _retire_current_call(self) -> None:
        if self._pending:
            self._pending.pop(0)

    def close(self, abort: bool = False) -> None:
        """Stop the worker after the queued calls (``abort``: without waiting for them)."""
        with self._lock:
            worker, work = self._worker, self._work
            self._worker = self._work = None
        if worker is not None and work is not None:
            work.put(None)
            if not abort:
                worker.join()
        self._pending = []


class _PersistentCall(AsyncCaller):
    """One queue's request run by the process-wide :class:`PersistentAsyncCaller`.

    It tracks that request alone, so queues sharing the writer never see (or retire) each other's calls.
    """

    def __init__(self, writer: PersistentAsyncCaller) -> None:
        self.writer = writer
        self._call: _QueuedCall | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Run ``preload_fn`` here, then queue ``async_fn`` on the shared writer thread."""
        self._call = self.writer._submit(async_req)

    @property
    def error(self) -> BaseException | None:
        """The failure of this request, if it failed."""
        return self._call.error if self._call is not None else None

    def _current_call_alive(self, blocking: bool) -> bool:
        if self._call is None:
            return False
        if blocking:
            self._call.done.wait()
        return not self._call.done.is_set()

    def _retire_current_call(self) -> None:
        self._call = None

    def close(self, abort: bool = False) -> None:
        """Wait for this request unless ``abort``; the shared writer keeps running."""
        if self._call is not None and not abort:
            self._call.done.wait()
        self._call = None


class AsyncCallsQueue:
    """Runs scheduled :class:`AsyncRequest` writes in the background and finalizes them in order.

    ``persistent=True`` runs every request on the process-wide :class:`PersistentAsyncCaller` (one worker
    thread, requests in order) shared by all persistent queues, as in Megatron-Core; otherwise each
    request gets a :class:`TemporalAsyncCaller` (a thread of its own).
    """

    # The process-wide persistent writer (Megatron-Core 0.19), and the persistent queues that scheduled on it.
    _persistent_caller: ClassVar[PersistentAsyncCaller | None] = None
    _persistent_users: ClassVar[weakref.WeakSet[AsyncCallsQueue]] = weakref.WeakSet()
    _persistent_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self.async_calls: list[tuple[int, AsyncCaller, AsyncRequest]] = []
        self.call_idx = -1

    @classmethod
    def warmup_persistent_caller(cls, rank: int, mp_mode: str = "spawn", cpu_priority: int = 10,
                                 io_priority: int | None = None) -> None:
        """Start the process-wide persistent writer now, with these priorities, so the first save pays nothing.

        Args:
            rank: this process's rank, for log messages only.
            mp_mode: a ``multiprocessing`` start method, accepted for Megatron-Core compatibility and
                validated; our writer is a thread, so it changes nothing else.
            cpu_priority: nice value of the writer thread (0-19, None keeps training's).
            io_priority: ``ionice`` class of the writer thread (0-3, None keeps it).

        A writer that already exists is kept, with its priorities (as Megatron-Core does).
        """
        allowed = multiprocessing.get_all_start_methods()
        if mp_mode not in allowed:
            raise ValueError(f"mp_mode ({mp_mode!r}) must be a multiprocessing start method: one of {allowed}")
        check_qos(cpu_priority, io_priority)
        with AsyncCallsQueue._persistent_lock:
            writer = AsyncCallsQueue._persistent_caller
            if writer is None:
                writer = AsyncCallsQueue._persistent_caller = PersistentAsyncCaller(cpu_priority, io_priority)
                logger.debug("rank %s: starting the persistent checkpoint writer (cpu_priority=%r, io_priority=%r)",
                             rank, cpu_priority, io_priority)
            elif (writer.cpu_priority, writer.io_priority) != (cpu_priority, io_priority):
                logger.debug("rank %s: the persistent checkpoint writer exists with cpu_priority=%r, io_priority=%r; "
                             "kept (cpu_priority=%r, io_priority=%r ignored)", rank, writer.cpu_priority,
                             writer.io_priority, cpu_priority, io_priority)
        writer.start(wait=True)
        logger.debug("rank %s: persistent checkpoint writer running", rank)

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller()
        with AsyncCallsQueue._persistent_lock:
            if AsyncCallsQueue._persistent_caller is None:
                AsyncCallsQueue._persistent_caller = PersistentAsyncCaller()
            AsyncCallsQueue._persistent_users.add(self)
            return _PersistentCall(AsyncCallsQueue._persistent_caller)

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
        """Finalize everything still scheduled (collective; skipped with ``abort``) and release the writer.

        A persistent queue then closes the process-wide persistent writer (``abort``: without waiting for
        its queued writes) and clears it, so a later persistent queue starts a fresh one, as in
        Megatron-Core; unlike Megatron-Core, not while another persistent queue that scheduled on it
        has not been closed (that one closes it). A non-persistent queue leaves it alone. The writer is
        released also when finalizing raises.
        """
        try:
            if not abort:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            if self.persistent:
                self._release_persistent_caller(abort)

    def _release_persistent_caller(self, abort: bool) -> None:
        """Stop using the shared writer; close and clear it unless another persistent queue still uses it."""
        with AsyncCallsQueue._persistent_lock:
            AsyncCallsQueue._persistent_users.discard(self)
            writer = AsyncCallsQueue._persistent_caller
            if writer is None:
                return
            if len(AsyncCallsQueue._persistent_users):
                logger.debug("persistent checkpoint writer kept open: %d other queue(s) still use it",
                             len(AsyncCallsQueue._persistent_users))
                return
            AsyncCallsQueue._persistent_caller = None
        writer.close(abort=abort)
