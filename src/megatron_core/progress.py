"""Progress display for long jobs: a ``tqdm`` bar on a terminal, plain log lines otherwise.

``tqdm`` is optional (``pip install tqdm``; in the ``dev`` extra) and imported here only, lazily.
Without it, or when the stream is not a terminal (a log file, CI, a pipe), callers get plain lines
instead, so logs stay readable. Used by training (``examples/pretrain_gpt.py``), evaluation,
``megatron-preprocess-data`` and ``megatron-convert``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

__all__ = ["ProgressBar", "load_tqdm", "progress_bar", "track"]


def load_tqdm() -> Any:
    """The ``tqdm`` class, or ``None`` when the package is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class ProgressBar:
    """A tqdm bar over ``total`` steps with a status line (made by :func:`progress_bar`)."""

    def __init__(self, bar: Any, stream: TextIO) -> None:
        self._bar, self._stream = bar, stream

    def update(self, n: int = 1, status: str | None = None) -> None:
        """Advance by ``n`` steps and show ``status`` (a short line of numbers) beside the bar."""
        if status is not None:
            self._bar.set_postfix_str(status, refresh=False)
        self._bar.update(n)

    def set_position(self, position: int, status: str | None = None) -> None:
        """Move to step ``position`` (e.g. a resumed run's iteration) and show ``status``."""
        self.update(position - self._bar.n, status)

    def write(self, message: str) -> None:
        """Print ``message`` above the bar (the bar is redrawn below it)."""
        self._bar.write(message, file=self._stream)

    def close(self) -> None:
        """Finish the bar (leaves its last state on the terminal)."""
        self._bar.close()


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True,
                 stream: TextIO | None = None, initial: int = 0, transient: bool = False) -> ProgressBar | None:
    """A :class:`ProgressBar` on ``stream`` (default stderr), or ``None``: then print plain lines yourself.

    ``None`` when ``enabled`` is false, ``tqdm`` is not installed, or ``stream`` is not a terminal.
    ``total=None`` shows a counter and a rate without a bar; a ``transient`` bar is erased when closed.
    """
    stream = stream if stream is not None else sys.stderr
    tqdm = load_tqdm() if enabled and _is_terminal(stream) else None
    if tqdm is None:
        return None
    bar = tqdm(total=total, desc=desc, unit=unit, file=stream, initial=initial, dynamic_ncols=True,
               leave=not transient)
    return ProgressBar(bar, stream)


def track(items: Iterable[T], total: int, desc: str, unit: str = "it", enabled: bool = True,
          stream: TextIO | None = None, lines: int = 10, transient: bool = False) -> Iterator[T]:
    """Yield ``items`` with a bar on a terminal; otherwise print ``lines`` plain ``desc: k/total`` lines.

    ``lines=0`` prints nothing in the fallback. Nothing at all is shown when ``enabled`` is false.
    """
    stream = stream if stream is not None else sys.stderr
    bar = progress_bar(total, desc, unit, enabled, stream, transient=transient)
    if bar is not None:
        try:
            for item in items:
                yield item
                bar.update()
        finally:
            bar.close()
        return
    step = max(1, total // lines) if enabled and lines > 0 else 0
    for count, item in enumerate(items, start=1):
        yield item
        if step and (count % step == 0 or count == total):
            print(f"{desc}: {count}/{total} {unit}", file=stream, flush=True)
