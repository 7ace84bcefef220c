"""The global ``args`` of the stand-in ``megatron.training``."""

from __future__ import annotations

import argparse

_ARGS: argparse.Namespace | None = None


def get_args() -> argparse.Namespace:
    """The namespace last returned by ``arguments.parse_args``."""
    return _ARGS


def set_args(args: argparse.Namespace) -> None:
    """Record ``args`` as the global arguments."""
    global _ARGS
    _ARGS = args
