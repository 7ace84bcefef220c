"""NVTX ranges for profiling, off until ``configure_nvtx_profiling(True)`` (re-exported by ``utils``).

Ranges are kept on a stack so a pop with a message must match the last push; without CUDA the
ranges are tracked but nothing is emitted (``megatron_core.device`` decides).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from megatron_core import device

F = TypeVar("F", bound=Callable[..., Any])

_nvtx_enabled = False
_nvtx_range_messages: list[str] = []
_nvtx_range_msg_pool: dict[str, str] = {}


def configure_nvtx_profiling(enabled: bool) -> None:
    """Switch NVTX range profiling on or off."""
    global _nvtx_enabled
    _nvtx_enabled = bool(enabled)


def _caller_path(depth: int = 2) -> str:
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[union-attr]
    module = inspect.getmodule(frame)
    name = module.__name__ if module is not None else "<unknown>"
    return f"{name}.{frame.f_code.co_name}"  # type: ignore[union-attr]


def _message(msg: str | None, suffix: str | None) -> str:
    if msg is None:
        msg = _caller_path(3)
    return f"{msg}.{suffix}" if suffix is not None else msg


def nvtx_range_push(msg: str | None = None, suffix: str | None = None) -> None:
    """Open a range named ``msg`` (default: the caller's ``module.function``), plus ``.suffix``."""
    if not _nvtx_enabled:
        return
    text = _message(msg, suffix)
    text = _nvtx_range_msg_pool.setdefault(text, text)
    _nvtx_range_messages.append(text)
    device.nvtx_range_push(text)


def nvtx_range_pop(msg: str | None = None, suffix: str | None = None) -> None:
    """Close the last range; ``ValueError`` if ``msg`` (default: the caller's path) does not match it."""
    if not _nvtx_enabled:
        return
    text = _message(msg, suffix)
    if not _nvtx_range_messages:
        raise RuntimeError("nvtx_range_pop: no NVTX range is open")
    last = _nvtx_range_messages.pop()
    if text != last:
        raise ValueError(f"nvtx_range_pop: msg={text!r} does not match the open range {last!r}")
    device.nvtx_range_pop()


def nvtx_decorator(message: str | None = None) -> Callable[[F], F]:
    """Wrap a function in an NVTX range (``message`` or its ``module.function``), checked at call time."""

    def decorate(func: F) -> F:
        module = inspect.getmodule(func)
        text = message or f"{module.__name__ if module else '<unknown>'}.{func.__name__}"

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nvtx_range_push(text)
            try:
                return func(*args, **kwargs)
            finally:
                nvtx_range_pop(text)

        return wrapper  # type: ignore[return-value]

    return decorate
