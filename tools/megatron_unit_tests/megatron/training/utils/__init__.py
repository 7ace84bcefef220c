"""``megatron.training.utils`` of the stand-in: ``get_args`` only (the tests patch it); the rest is not provided."""

from __future__ import annotations

from megatron.training.global_vars import get_args

__all__ = ["get_args"]
