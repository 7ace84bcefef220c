"""The process-wide persistent writer of ``AsyncCallsQueue`` and ``warmup_persistent_caller`` (Megatron-Core 0.19)."""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Iterator

import pytest

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.strategies import async_utils
from megatron_core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)

WAIT_S = 30


def _reset_persistent_writer() -> None:
    """Close the process-wide writer, if any, and forget which queues used it."""
    with AsyncCallsQueue._persistent_lock:
        writer = AsyncCallsQueue._persistent_caller
        AsyncCallsQueue._persistent_caller = None
        AsyncCallsQueue._persistent_users.clear()
    if writer is not None:
        writer.close()


@pytest.fixture(autouse=True)
def fresh_persistent_writer() -> Iterator[None]:
    _reset_persistent_writer()
    yield
    _reset_persistent_writer()


def _writer() -> PersistentAsyncCaller:
    writer = AsyncCallsQueue._persistent_caller
    assert writer is not None
    return writer


def _writer_thread() -> threading.Thread:
    thread = _writer()._worker
    assert thread is not None
    return thread


def _gated(gate: threading.Event, seen: list[int]) -> AsyncRequest:
    """A request whose write records its thread and waits for ``gate``."""
    return AsyncRequest(lambda: (seen.append(threading.get_ident()), gate.wait(WAIT_S)), (), [])


def test_signature_matches_megatron_core():
    params = inspect.signature(AsyncCallsQueue.warmup_persistent_caller).parameters
    assert list(params) == ["rank", "mp_mode", "cpu_priority", "io_priority"]
    assert [p.default for p in params.values()] == [inspect.Parameter.empty, "spawn", 10, None]
    assert isinstance(inspect.getattr_static(AsyncCallsQueue, "warmup_persistent_caller"), classmethod)


def test_warmup_starts_the_writer_before_any_request():
    assert AsyncCallsQueue._persistent_caller is None
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if hasattr(os, "getpriority") else None
    AsyncCallsQueue.warmup_persistent_caller(0, cpu_priority=13)
    thread = _writer_thread()
    assert thread.is_alive() and thread in threading.enumerate() and thread.name == "mcore-ckpt-writer"
    assert _writer().cpu_priority == 13 and _writer().io_priority is None
    if sys.platform.startswith("linux"):  # the nice value is per thread only there
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == max(13, main_before)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


def test_a_request_after_warmup_runs_on_the_warmed_thread_and_finalizes():
    AsyncCallsQueue.warmup_persistent_caller(0)
    warmed = _writer_thread()
    seen: list[int] = []
    finalized: list[str] = []
    queue = AsyncCallsQueue(persistent=True)
    queue.schedule_async_request(AsyncRequest(lambda: seen.append(threading.get_ident()), (),
                                              [lambda: finalized.append("done")]))
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    assert seen == [warmed.ident] and finalized == ["done"] and _writer_thread() is warmed
    queue.close()
    assert not warmed.is_alive()


def test_persistent_caller_start_runs_later_requests_on_the_same_thread():
    caller = PersistentAsyncCaller(cpu_priority=None)
    try:
        thread = caller.start()
        assert thread.is_alive() and caller.start() is thread
        seen: list[int] = []
        caller.schedule_async_call(AsyncRequest(lambda: seen.append(threading.get_ident()), (), []))
        assert caller.is_current_async_call_done(blocking=True, no_dist=True) and seen == [thread.ident]
    finally:
        caller.close()
    assert not thread.is_alive()


def test_two_persistent_queues_share_one_writer_and_finalize_only_their_own_calls():
    gate, seen = threading.Event(), []
    first, second = AsyncCallsQueue(persistent=True), AsyncCallsQueue(persistent=True)
    try:
        first.schedule_async_request(_gated(gate, seen))
        writer = _writer()
        second.schedule_async_request(AsyncRequest(lambda: seen.append(threading.get_ident()), (), []))
        assert _writer() is writer
        # the second queue's call waits behind the first one's on the one thread
        assert second.maybe_finalize_async_calls(no_dist=True) == [] and second.get_num_unfinalized_calls() == 1
        assert first.maybe_finalize_async_calls(no_dist=True) == []
        gate.set()
        assert second.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        assert first.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        assert seen == [writer._worker.ident] * 2
    finally:
        gate.set()
        first.close()
        second.close()


def test_a_failure_is_reported_only_by_the_queue_whose_write_failed():
    def boom() -> None:
        raise OSError("disk gone")

    failing, healthy = AsyncCallsQueue(persistent=True), AsyncCallsQueue(persistent=True)
    try:
        failing.schedule_async_request(AsyncRequest(boom, (), []))
        healthy.schedule_async_request(AsyncRequest(lambda: None, (), []))
        assert healthy.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        with pytest.raises(CheckpointingException, match="save 0 failed: OSError: disk gone"):
            failing.maybe_finalize_async_calls(blocking=True, no_dist=True)
    finally:
        failing.close()
        healthy.close()


def test_close_clears_the_writer_and_a_later_queue_gets_a_fresh_one():
    AsyncCallsQueue.warmup_persistent_caller(0)
    warmed, warmed_thread = _writer(), _writer_thread()
    queue = AsyncCallsQueue(persistent=True)
    queue.schedule_async_request(AsyncRequest(lambda: None, (), []))
    queue.close()
    assert AsyncCallsQueue._persistent_caller is None and not warmed_thread.is_alive()
    later = AsyncCallsQueue(persistent=True)
    try:
        later.schedule_async_request(AsyncRequest(lambda: None, (), []))
        assert _writer() is not warmed and _writer_thread().is_alive()
        assert later.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    finally:
        later.close()
    assert AsyncCallsQueue._persistent_caller is None


def test_closing_a_queue_that_never_used_the_writer_keeps_it_for_the_queue_that_does():
    gate, seen = threading.Event(), []
    user = AsyncCallsQueue(persistent=True)
    try:
        user.schedule_async_request(_gated(gate, seen))
        writer, thread = _writer(), _writer_thread()
        AsyncCallsQueue(persistent=True).close()
        AsyncCallsQueue(persistent=False).close()
        assert _writer() is writer and thread.is_alive()
        gate.set()
        assert user.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0] and seen == [thread.ident]
    finally:
        gate.set()
        user.close()
    assert AsyncCallsQueue._persistent_caller is None and not thread.is_alive()


def test_closing_one_of_two_users_keeps_the_writer_until_the_last_one_closes():
    first, second = AsyncCallsQueue(persistent=True), AsyncCallsQueue(persistent=True)
    for queue in (first, second):
        queue.schedule_async_request(AsyncRequest(lambda: None, (), []))
    thread = _writer_thread()
    first.close()
    assert thread.is_alive() and AsyncCallsQueue._persistent_caller is not None
    second.close()
    assert AsyncCallsQueue._persistent_caller is None and not thread.is_alive()


def test_an_unused_persistent_queue_closes_a_warmed_writer_nobody_uses():
    AsyncCallsQueue.warmup_persistent_caller(0)
    thread = _writer_thread()
    AsyncCallsQueue(persistent=True).close()  # as Megatron-Core: e.g. a run that never saved
    assert AsyncCallsQueue._persistent_caller is None and not thread.is_alive()


def test_close_with_abort_does_not_wait_for_the_write():
    gate, seen = threading.Event(), []
    queue = AsyncCallsQueue(persistent=True)
    queue.schedule_async_request(_gated(gate, seen))
    thread = _writer_thread()
    try:
        queue.close(abort=True)
        assert AsyncCallsQueue._persistent_caller is None and thread.is_alive()
    finally:
        gate.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and seen == [thread.ident]


def test_a_second_warmup_keeps_the_first_writer_and_its_priorities(caplog):
    AsyncCallsQueue.warmup_persistent_caller(0, cpu_priority=11)
    first, thread = _writer(), _writer_thread()
    with caplog.at_level(logging.DEBUG, logger=async_utils.__name__):
        AsyncCallsQueue.warmup_persistent_caller(1, cpu_priority=15, io_priority=3)
    assert _writer() is first and _writer_thread() is thread and (first.cpu_priority, first.io_priority) == (11, None)
    assert any(r.levelno == logging.DEBUG and "kept" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mp_mode", multiprocessing.get_all_start_methods())
def test_every_multiprocessing_start_method_is_accepted(mp_mode):
    AsyncCallsQueue.warmup_persistent_caller(0, mp_mode=mp_mode)
    assert _writer_thread().is_alive()


@pytest.mark.parametrize("kwargs, field, value", [
    ({"mp_mode": "thread"}, "mp_mode", "'thread'"),
    ({"mp_mode": None}, "mp_mode", "None"),
    ({"cpu_priority": 20}, "cpu_priority", "20"),
    ({"cpu_priority": -1}, "cpu_priority", "-1"),
    ({"io_priority": 4}, "io_priority", "4"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, field, value):
    with pytest.raises(ValueError, match=rf"{field} \({value}\)") as info:
        AsyncCallsQueue.warmup_persistent_caller(0, **kwargs)
    if field == "mp_mode":
        assert all(method in str(info.value) for method in multiprocessing.get_all_start_methods())
    assert AsyncCallsQueue._persistent_caller is None
