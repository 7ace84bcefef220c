"""Keeping a checkpoint writer out of training's way: ``_disable_gc`` and ``_set_process_qos``.

Megatron-Core 0.19 (``strategies.async_utils``) defines both; Megatron-LM imports them for its
background checkpoint deletion. ``_set_process_qos`` lowers the CPU priority (nice) and optionally
the I/O class (``ionice``) of the caller; a failure to do so is logged as a warning, never raised.
Megatron-Core applies it to its checkpoint writer *process*; our writer is a thread, so it acts on
the calling thread: on Linux the nice value and the I/O priority belong to each thread (a process's
main thread has the process id as its thread id, so in a writer process both readings agree).

``_disable_gc`` switches the garbage collector off for a block (``with _disable_gc():`` or
``@_disable_gc()``) and restores its state afterwards, also after an exception. The collector is one
per interpreter, so the switch counts nested holders across threads: it is restored only when the last
block exits, and a thread leaving its block never re-enables the collector under another one.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

NICE_RANGE = range(0, 20)
IONICE_CLASSES = range(0, 4)  # 0 none, 1 realtime, 2 best-effort, 3 idle
IONICE_TIMEOUT_S = 30  # an ionice that hangs is given up on (a warning), never waited for

_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


def check_qos(cpu_priority: int | None, io_priority: int | None) -> None:
    """``ValueError`` unless ``cpu_priority`` is None or a nice value 0-19 and ``io_priority`` None or a class 0-3."""
    if cpu_priority is not None and (isinstance(cpu_priority, bool) or cpu_priority not in NICE_RANGE):
        raise ValueError(f"cpu_priority ({cpu_priority!r}) must be None or a nice value from 0 to 19")
    if io_priority is not None and (isinstance(io_priority, bool) or io_priority not in IONICE_CLASSES):
        raise ValueError(f"io_priority ({io_priority!r}) must be None or an ionice class from 0 to 3 "
                         "(0 none, 1 realtime, 2 best-effort, 3 idle)")


def _set_process_qos(cpu_priority: int | None, io_priority: int | None) -> None:
    """Deprioritize the calling thread (in a writer process: the process) so checkpoint writing yields to training.

    Args:
        cpu_priority: target nice value, 0-19 (higher yields more); None leaves it. The nice value is only
            raised: when it is already at or above the target nothing changes and a warning is logged
            (lowering it needs superuser rights, as in Megatron-Core).
        io_priority: ``ionice`` scheduling class, 0-3 (3: idle, served only when no other I/O waits);
            None leaves it.

    A value out of range raises ``ValueError`` (Megatron-Core ignores an out-of-range ``cpu_priority``).
    An ``OSError`` from ``nice`` and a missing or failing ``ionice`` are logged as warnings, not raised.
    """
    check_qos(cpu_priority, io_priority)
    tid = threading.get_native_id()
    if cpu_priority is not None:
        try:
            current = os.nice(0)
            if cpu_priority <= current:
                logger.warning("thread %d: CPU nice not changed: current %d is already at or above the target %d "
                               "(lowering it requires superuser)", tid, current, cpu_priority)
            else:
                logger.debug("thread %d: CPU nice %d -> %d", tid, current, os.nice(cpu_priority - current))
        except OSError as e:  # PermissionError is an OSError
            logger.warning("thread %d: failed to set CPU priority: %s", tid, e)
    if io_priority is not None:
        try:
            subprocess.run(["ionice", "-c", str(io_priority), "-p", str(tid)], check=True, capture_output=True,
                           timeout=IONICE_TIMEOUT_S)
            logger.debug("thread %d: I/O priority class set to %d", tid, io_priority)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:  # OSError: no ionice
            logger.warning("thread %d: failed to set I/O priority: %s", tid, e)


@contextmanager
def _disable_gc() -> Iterator[None]:
    """Garbage collection off while the block runs; its earlier state back when the last such block exits."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()
