"""What the dynamic context raises when a request does not fit (Megatron-Core's ``dynamic_context`` errors).

``is_transient`` tells a caller whether waiting can help: no free request place or KV block is transient
(requests finish and free theirs), a request longer than the context allows is not. Megatron-Core's path,
``megatron_core.inference.contexts.dynamic_context``, re-exports them all. :class:`ContextErrorFactory` turns an
error into plain data and back (to send it between processes).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ActiveRequestCountOverflowError",
    "BlockOverflowError",
    "ContextErrorFactory",
    "ContextOverflowError",
    "MaxSequenceLengthOverflowError",
    "RequestOverflowError",
    "TensorStateDeallocatedError",
    "TokenOverflowError",
]


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


class MaxSequenceLengthOverflowError(TokenOverflowError):
    """The request would grow past ``max_sequence_length`` (never transient).

    A :class:`TokenOverflowError` too, which this library's callers catch for every over-long request (in
    Megatron-Core 0.19 it derives from :class:`ContextOverflowError` only).
    """


class ActiveRequestCountOverflowError(ContextOverflowError):
    """More active requests than the context's ``max_requests`` (e.g. warm-up requests)."""

    def __init__(self, max_request_count: int, active_request_count: int) -> None:
        if active_request_count <= max_request_count:
            raise ValueError(f"ActiveRequestCountOverflowError needs active_request_count ({active_request_count}) > "
                             f"max_request_count ({max_request_count})")
        super().__init__(None, f"active_request_count ({active_request_count}) > max_request_count "
                               f"({max_request_count}).")


class TensorStateDeallocatedError(ContextOverflowError):
    """The context's tensors are released (the engine is suspended)."""


_ERROR_CLASSES = {cls.__name__: cls for cls in (
    ContextOverflowError, RequestOverflowError, TokenOverflowError, MaxSequenceLengthOverflowError,
    BlockOverflowError, ActiveRequestCountOverflowError, TensorStateDeallocatedError)}


class ContextErrorFactory:
    """Context errors to plain data (``serialize``) and back (``deserialize``), e.g. across processes."""

    @classmethod
    def serialize(cls, error: ContextOverflowError) -> dict[str, Any]:
        """``{"type", "request_id", "message", "is_transient"}`` of ``error``."""
        if not isinstance(error, ContextOverflowError):
            raise TypeError(f"ContextErrorFactory.serialize takes a ContextOverflowError, got {type(error).__name__}")
        return {"type": type(error).__name__, "request_id": error.request_id, "message": error.message,
                "is_transient": error.is_transient}

    @classmethod
    def deserialize(cls, obj: dict[str, Any]) -> ContextOverflowError:
        """The error :meth:`serialize` described: same class, request id, message and transience."""
        error_cls = _ERROR_CLASSES.get(obj.get("type"))
        if error_cls is None:
            raise ValueError(f"ContextErrorFactory.deserialize: unknown error type {obj.get('type')!r}; known: "
                             f"{sorted(_ERROR_CLASSES)}")
        error = error_cls.__new__(error_cls)
        ContextOverflowError.__init__(error, obj["request_id"], obj.get("message"),
                                      is_transient=bool(obj.get("is_transient", True)))
        return error
