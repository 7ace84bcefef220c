"""A checkpoint write that fails for lack of disk space says so, with the path and the bytes needed and free.

A full disk reaches a save as ``OSError(ENOSPC)`` (or ``EDQUOT``), or, from ``torch.save``'s zip
writer, as ``RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos 704 vs 598``,
which never mentions space. :func:`explain_write_failure` turns either into a
:class:`CheckpointNoSpaceError` (an ``OSError`` with ``errno.ENOSPC``) naming the directory, the
bytes this rank was writing and the bytes free there. The save's temporary directory is removed
by the caller; the previous checkpoint and the tracker are never touched. Not in Megatron-Core.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CheckpointNoSpaceError", "explain_write_failure", "explaining_space", "state_nbytes"]

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What torch's zip writer says when a write came out short (the disk filled up under it).
_SHORT_WRITE_MARKERS = ("unexpected pos", "file write failed", "PytorchStreamWriter failed", "No space left")


class CheckpointNoSpaceError(OSError):
    """A checkpoint could not be written: no space left on the device."""


def state_nbytes(values: Any) -> int:
    """Bytes of the tensors among ``values`` (a rough size of what this rank writes)."""
    total = 0
    for value in values:
        data = getattr(value, "data", value)
        if isinstance(data, torch.Tensor):
            total += data.numel() * data.element_size()
    return total


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _free_bytes(directory: str | os.PathLike) -> int | None:
    path = os.path.abspath(directory)
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def explain_write_failure(error: BaseException, directory: str | os.PathLike, needed: int = 0) -> BaseException:
    """``error``, or a :class:`CheckpointNoSpaceError` saying that the device is full, when that is the cause."""
    if isinstance(error, CheckpointNoSpaceError):
        return error
    free = _free_bytes(directory)
    errno_full = any(isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS for e in _chain(error))
    short_write = any(isinstance(e, RuntimeError) and any(m in str(e) for m in _SHORT_WRITE_MARKERS)
                      for e in _chain(error))
    if not errno_full and not (short_write and free is not None and free < max(needed, 1) + (1 << 20)):
        return error
    first_line = (str(error).strip().splitlines() or [""])[0]
    free_text = "unknown" if free is None else f"{free:,}"
    return CheckpointNoSpaceError(
        errno.ENOSPC,
        f"no space left on device while writing checkpoint files into {directory}: this rank writes about "
        f"{needed:,} bytes, {free_text} bytes are free there; the previous checkpoint and the tracker are unchanged. "
        f"Free some space or save elsewhere ({type(error).__name__}: {first_line})")


def explaining_space(fn: Callable[..., Any], directory: str | os.PathLike, needed: int) -> Callable[..., Any]:
    """``fn`` with its failures passed through :func:`explain_write_failure`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - re-raised, explained when the disk is full
            explained = explain_write_failure(error, directory, needed)
            if explained is error:
                raise
            raise explained from error

    return run
