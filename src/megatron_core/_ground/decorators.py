"""Small decorators Megatron-Core's ``utils`` exports: a no-op stand-in and deprecated-argument guards.

``null_decorator`` replaces ``triton.jit`` / ``triton.autotune`` / ``triton.heuristics`` when Triton is
missing, so a module defining kernels still imports. ``deprecate_args`` turns removed keyword arguments into a
``TypeError`` that names them; ``deprecate_inference_params`` maps the old ``inference_params`` argument
onto ``inference_context`` with a warning.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["deprecate_args", "deprecate_inference_params", "null_decorator"]


def null_decorator(*args: Any, **kwargs: Any) -> Any:
    """A decorator that changes nothing, used bare (``@null_decorator``) or with arguments (``@null_decorator(...)``)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]

    def identity(func: F) -> F:
        return func

    return identity


def deprecate_args(
    *deprecated_keys: str, message: str = "Argument '{name}' has been deprecated and should not be used."
) -> Callable[[F], F]:
    """Make the decorated callable raise ``TypeError`` (``message`` with ``{name}``) when called with any of
    ``deprecated_keys`` as a keyword argument."""
    blocked = frozenset(deprecated_keys)

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for name in kwargs:
                if name in blocked:
                    raise TypeError(message.format(name=name))
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def deprecate_inference_params(inference_context: Any, inference_params: Any) -> Any:
    """``inference_context``, or the deprecated ``inference_params`` (with a warning) when only it is given."""
    if inference_context is None and inference_params is not None:
        warnings.warn(
            "`inference_params` has been renamed to `inference_context`; pass `inference_context` instead.",
            stacklevel=2,
        )
        return inference_params
    return inference_context
