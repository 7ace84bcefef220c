"""Scoped timing and debug messages for checkpoint code (Megatron-Core's ``dist_checkpointing.utils`` helpers).

:func:`logger_stack` pushes a scope name (and optionally a logger) for the duration of a ``with`` block;
:func:`debug_time` times a block and logs ``"<outer>.<inner> took 0.1234s"`` with the innermost logger;
:func:`debug_msg` logs a DEBUG message prefixed with the current scope. The stacks are process-global, as
in Megatron-Core (checkpoint code runs on one thread per process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["debug_msg", "debug_time", "fallback_logger", "logger_stack"]

fallback_logger = logging.getLogger(__name__)
_NAMES: list[str] = []
_LOGGERS: list[logging.Logger] = []


@contextmanager
def logger_stack(name: str | None = None,
                 current_logger: logging.Logger | None = None) -> Iterator[tuple[str, logging.Logger]]:
    """Push ``name`` and ``current_logger`` (each if given) for the block; yields ``(dotted scope, logger)``,
    the logger being the innermost pushed one, else :data:`fallback_logger`."""
    if name:
        _NAMES.append(name)
    if current_logger:
        _LOGGERS.append(current_logger)
    active = _LOGGERS[-1] if _LOGGERS else fallback_logger
    try:
        yield ".".join(_NAMES), active
    finally:
        if name and _NAMES:
            _NAMES.pop()
        if current_logger and _LOGGERS:
            _LOGGERS.pop()


@contextmanager
def debug_time(name: str, logger: logging.Logger | None = None, threshold: float = float("-inf"),
               level: int | None = None) -> Iterator[None]:
    """Log how long the block took as ``"<scope> took <seconds>s"`` unless it took less than ``threshold``
    seconds; at ``level``, by default DEBUG without a threshold and WARNING with one."""
    with logger_stack(name, logger) as (scope, active):
        start = time.time()
        try:
            yield
        finally:
            elapsed = time.time() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                active.log(level, f"{scope} took {elapsed:.4f}s")


def debug_msg(msg: str) -> None:
    """Log ``"<scope> <msg>"`` at DEBUG with the innermost logger of :func:`logger_stack`."""
    with logger_stack() as (scope, active):
        active.debug(f"{scope} {msg}")
