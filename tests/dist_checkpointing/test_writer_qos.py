"""``strategies.async_utils._disable_gc`` / ``_set_process_qos`` and the persistent writer thread's priority.

Every priority change runs in a thread of its own: on Linux the nice value and the I/O class are per
thread, so the test process's main thread is never deprioritized.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest

from megatron_core.dist_checkpointing.strategies import _writer_qos
from megatron_core.dist_checkpointing.strategies.async_utils import (
    AsyncRequest,
    PersistentAsyncCaller,
    _disable_gc,
    _set_process_qos,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs POSIX priorities")


def _in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a fresh thread; its result (or its exception, re-raised here)."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join(30)
    if "error" in out:
        raise out["error"]
    return out["value"]


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_disable_gc_restores_after_the_block_and_after_an_exception(gc_enabled):
    with _disable_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), _disable_gc():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_disable_gc_as_decorator_and_keeps_a_disabled_collector_disabled(gc_enabled):
    @_disable_gc()
    def inside() -> bool:
        return gc.isenabled()

    assert inside() is False and gc.isenabled()
    gc.disable()
    assert inside() is False and not gc.isenabled()


def test_disable_gc_nested_across_threads_restores_only_when_the_last_block_exits(gc_enabled):
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _disable_gc():
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(10)
    with _disable_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's block still runs
    release.set()
    holder.join(10)
    assert gc.isenabled()


def test_set_process_qos_raises_this_threads_nice_only():
    main_before = _nice()
    assert _in_thread(lambda: (_set_process_qos(cpu_priority=12, io_priority=None), _nice())[1]) == 12
    assert _nice() == main_before


@pytest.mark.skipif(shutil.which("ionice") is None, reason="needs util-linux ionice")
def test_set_process_qos_sets_this_threads_io_class():
    def io_class(tid: int) -> str:
        return subprocess.run(["ionice", "-p", str(tid)], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    def probe() -> str:
        _set_process_qos(cpu_priority=None, io_priority=3)
        return io_class(threading.get_native_id())

    main_before = io_class(threading.get_native_id())
    assert _in_thread(probe).strip() == "idle"
    assert io_class(threading.get_native_id()) == main_before


def test_set_process_qos_never_lowers_nice(caplog):
    def probe() -> int:
        os.nice(15 - os.nice(0))
        _set_process_qos(cpu_priority=10, io_priority=None)
        return _nice()

    with caplog.at_level(logging.WARNING, logger=_writer_qos.__name__):
        assert _in_thread(probe) == 15
    assert "already at or above the target 10" in caplog.text


def _raise(exc: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


@pytest.mark.parametrize("nice_error, ionice_error", [
    (PermissionError(1, "Operation not permitted"), FileNotFoundError(2, "No such file: 'ionice'")),
    (OSError(22, "Invalid argument"), subprocess.CalledProcessError(1, ["ionice"], stderr=b"denied")),
])
def test_set_process_qos_logs_failures_instead_of_raising(monkeypatch, caplog, nice_error, ionice_error):
    monkeypatch.setattr(_writer_qos.os, "nice", _raise(nice_error))
    monkeypatch.setattr(_writer_qos.subprocess, "run", _raise(ionice_error))
    with caplog.at_level(logging.WARNING, logger=_writer_qos.__name__):
        _set_process_qos(cpu_priority=10, io_priority=3)
    assert "failed to set CPU priority" in caplog.text and "failed to set I/O priority" in caplog.text


@pytest.mark.parametrize("cpu, io, field", [(20, None, "cpu_priority"), (-1, None, "cpu_priority"),
                                            (None, 4, "io_priority"), (True, None, "cpu_priority")])
def test_out_of_range_priorities_are_refused(cpu, io, field):
    with pytest.raises(ValueError, match=field):
        _set_process_qos(cpu_priority=cpu, io_priority=io)
    with pytest.raises(ValueError, match=field):
        PersistentAsyncCaller(cpu_priority=cpu, io_priority=io)


def test_persistent_writer_thread_runs_at_nice_10_and_training_thread_does_not():
    main_before = _nice()
    seen: list[int] = []
    caller = PersistentAsyncCaller()
    caller.schedule_async_call(AsyncRequest(lambda: seen.append(_nice()), (), []))
    assert caller.is_current_async_call_done(blocking=True, no_dist=True)
    caller.close()
    assert seen == [max(10, main_before)] and _nice() == main_before
