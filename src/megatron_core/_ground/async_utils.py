"""Asyncio helpers of Megatron-Core's ``utils``: one event loop per thread and fail-loud coroutine tasks.

An exception raised inside an ``asyncio`` task is only reported when someone awaits the task, so a
background coroutine of the inference engine could die silently. :func:`trace_async_exceptions` logs the
error with its traceback and exits the process instead, as Megatron-Core does.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["get_asyncio_loop", "trace_async_exceptions"]

_LOOP: asyncio.AbstractEventLoop | None = None
_TASK_STATS: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [count, total ms]


def get_asyncio_loop(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.AbstractEventLoop:
    """``loop`` if given, else the running loop, else one loop created (and set as current) on first use."""
    global _LOOP
    if loop is not None:
        return loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            asyncio.set_event_loop(_LOOP)
        return _LOOP


def _record(name: str, start: float) -> None:
    """Add one completion of ``name``; log its time at counts 1, 10, 100, ... (Megatron-Core's cadence)."""
    elapsed_ms = (time.perf_counter() - start) * 1000.0
    stats = _TASK_STATS[name]
    count = int(stats[0])
    stats[0] += 1
    stats[1] += elapsed_ms
    power = math.log10(max(count, 1))
    if math.isclose(power, round(power)):
        logger.info("%s completed in %.3f ms, lifetime avg: %.3f ms, lifetime cnt: %d",
                    name, elapsed_ms, stats[1] / stats[0], int(stats[0]))


def _fail(kind: str, fn: Callable, error: Exception) -> None:
    logger.error("Exception in async %s %s: %s", kind, fn.__name__, error)
    traceback.print_exc()
    sys.exit(1)


def trace_async_exceptions(func: Callable | None = None, *, verbose: bool = False) -> Any:
    """Decorate a coroutine function or async generator so an exception in it is logged and exits the process.

    Use bare (``@trace_async_exceptions``) or as ``@trace_async_exceptions(verbose=True)``, which also logs
    the run time of every 1st, 10th, 100th, ... completion. Anything else raises ``TypeError``.
    """

    def decorate(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - a task's error must not vanish
                    _fail("function", fn, e)
                finally:
                    if verbose:
                        _record(fn.__qualname__, start)

            return wrapper
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def generator(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    async for item in fn(*args, **kwargs):
                        yield item
                except Exception as e:  # noqa: BLE001 - a task's error must not vanish
                    _fail("generator", fn, e)
                finally:
                    if verbose:
                        _record(fn.__qualname__, start)

            return generator
        raise TypeError(f"trace_async_exceptions needs an async function or async generator, got {fn!r}")

    return decorate if func is None else decorate(func)
