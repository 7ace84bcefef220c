"""What the dynamic context raises when a request does not fit (Megatron-Core's ``dynamic_context`` errors).

``is_transient`` tells a caller whether waiting can help: no free request place or KV block is transient
(requests finish and free theirs), a request longer than the context allows is not. Megatron-Core's path,
``megatron_core.inference.contexts.dynamic_context``, re-exports all four.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BlockOverflowError", "ContextOverflowError", "RequestOverflowError", "TokenOverflowError"]


class ContextOverflowError(Exception):
    """A request does not fit in the context."""

    def __init__(self, request_id: Any, message: str | None = None, *, is_transient: bool = True) -> None:
        super().__init__(f"request {'--' if request_id is None else request_id}" + (f" | {message}" if message else ""))
        self.request_id = request_id
        self.message = message
        self.is_transient = is_transient


class RequestOverflowError(ContextOverflowError):
    """Adding the request would exceed ``max_requests``."""


class TokenOverflowError(ContextOverflowError):
    """The request is longer than ``max_sequence_length`` or than one step's ``max_tokens``."""

    def __init__(self, request_id: Any, message: str | None = None) -> None:
        super().__init__(request_id, message, is_transient=False)


class BlockOverflowError(ContextOverflowError):
    """Not enough free KV blocks."""
