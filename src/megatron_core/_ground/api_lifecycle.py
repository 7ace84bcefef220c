"""API lifecycle markers: ``deprecated`` and ``experimental_api``, the policy of ``docs/api_policy.md``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from megatron_core import config

F = TypeVar("F", bound=Callable[..., Any])


class ExperimentalNotEnabledError(RuntimeError):
    """Raised when an experimental API is used without ``megatron_core.config.ENABLE_EXPERIMENTAL``."""


def deprecated(
    version: str, removal_version: str, alternative: str | None = None, reason: str | None = None
) -> Callable[[F], F]:
    """Mark a function or class deprecated: it warns on use and is removed in ``removal_version``."""

    def decorate(obj: F) -> F:
        message = f"{obj.__qualname__} is deprecated since {version} and will be removed in {removal_version}."
        if alternative:
            message += f" Use {alternative} instead."
        if reason:
            message += f" {reason}"

        if isinstance(obj, type):
            original_init = obj.__init__

            @functools.wraps(original_init)
            def init(self, *args, **kwargs):
                warnings.warn(message, DeprecationWarning, stacklevel=2)
                original_init(self, *args, **kwargs)

            obj.__init__ = init
            obj._deprecated = True
            return obj

        @functools.wraps(obj)
        def wrapper(*args, **kwargs):
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return obj(*args, **kwargs)

        wrapper._deprecated = True
        return wrapper  # type: ignore[return-value]

    return decorate


def experimental_api(obj: F) -> F:
    """Mark an API experimental: it raises unless ``config.ENABLE_EXPERIMENTAL`` is True."""
    if isinstance(obj, type):
        original_init = obj.__init__

        @functools.wraps(original_init)
        def init(self, *args, **kwargs):
            if not config.ENABLE_EXPERIMENTAL:
                raise ExperimentalNotEnabledError(
                    f"{obj.__qualname__} is experimental; set megatron_core.config.ENABLE_EXPERIMENTAL = True"
                )
            original_init(self, *args, **kwargs)

        obj.__init__ = init
        obj._experimental = True
        return obj

    @functools.wraps(obj)
    def wrapper(*args, **kwargs):
        if not config.ENABLE_EXPERIMENTAL:
            raise ExperimentalNotEnabledError(
                f"{obj.__qualname__} is experimental; set megatron_core.config.ENABLE_EXPERIMENTAL = True"
            )
        return obj(*args, **kwargs)

    wrapper._experimental = True
    return wrapper  # type: ignore[return-value]
