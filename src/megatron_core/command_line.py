"""The one rule every command-line tool of this package follows for errors.

A user error (a bad path or value, an existing output, a mismatched or corrupt checkpoint, a
missing optional extra) ends the command with one line ``<prog>: error: <what and where>`` on
stderr and exit status 2, as ``argparse`` does for a bad flag. Anything else is a bug in the
tool and keeps its Python traceback (exit status 1). ``MEGATRON_CLI_TRACEBACK=1`` shows the
traceback of a user error too. Not part of Megatron-Core; the console scripts
(``megatron-preprocess-data``, ``megatron-convert``, ``megatron-generate``) and the example
scripts call :func:`run_command`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["TRACEBACK_ENV", "UsageError", "is_user_error", "one_line", "run_command"]

TRACEBACK_ENV = "MEGATRON_CLI_TRACEBACK"


class UsageError(Exception):
    """An error the user can fix by changing the command line or the files it names."""


_USER_ERRORS: tuple[type[BaseException], ...] = (UsageError, ValueError, OSError, ImportError)
# ValueError covers the configs' validation, JSON and Unicode decoding and HFConversionError; OSError missing,
# unreadable and unwritable paths and a full disk; ImportError a missing optional extra. A checkpoint that does
# not fit is a CheckpointingException, recognised by name: importing dist_checkpointing here would load it (and
# torch's distributed modules) for every tool.
_CHECKPOINT_ERROR = ("megatron_core.dist_checkpointing.core", "CheckpointingException")


def is_user_error(error: BaseException) -> bool:
    """True for the exception types :func:`run_command` reports as one line with exit status 2."""
    if isinstance(error, _USER_ERRORS):
        return True
    return any((cls.__module__, cls.__name__) == _CHECKPOINT_ERROR for cls in type(error).__mro__)


def one_line(error: BaseException) -> str:
    """The error's message on one line (an ``OSError`` keeps its file name)."""
    text = str(error) or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in text:
        text = f"{text}: {error.filename}"
    return " ".join(text.split())


def run_command(prog: str, body: Callable[[], int | None]) -> int:
    """Run ``body`` (a tool's work) and return its exit status under the rule above.

    ``SystemExit`` (argparse's own exit 2 for a bad flag, ``--help``) passes through unchanged.
    """
    try:
        return body() or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as error:  # noqa: BLE001 - sorted into user errors and bugs right here
        if not is_user_error(error) or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
        return 2
