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


def experimental_fn(introduced_with_version: str) -> Callable[[F], F]:
    """Megatron-Core's decorator factory for an experimental function: :func:`experimental_api` (the version the
    function appeared in is recorded as ``_introduced_with_version``)."""
    def decorate(func: F) -> F:
        wrapped = experimental_api(func)
        wrapped._introduced_with_version = introduced_with_version
        return wrapped

    return decorate


def experimental_cls(introduced_with_version: str) -> Callable[[type], type]:
    """Megatron-Core's decorator factory for an experimental class: :func:`experimental_api` on the class, whose
    instances report ``is_experimental`` True."""
    def decorate(cls: type) -> type:
        cls = experimental_api(cls)
        cls.is_experimental = True
        cls._introduced_with_version = introduced_with_version
        return cls

    return decorate


def internal_api(obj: F) -> F:
    """Mark a function or class as internal (``obj._internal_api = True``): not covered by the compatibility
    policy of ``docs/api_policy.md``. The object itself is returned unchanged."""
    obj._internal_api = True
    return obj
