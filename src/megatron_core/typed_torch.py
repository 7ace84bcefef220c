"""Typing helpers around torch interfaces (Megatron-Core's ``typed_torch``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Generic, Literal, ParamSpec, Protocol, TypeVar

import torch

T = TypeVar("T")
P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)
# Of copy_signature: the source's and the decorated function's parameters and return types, and the decorated
# function's first parameter (kept with handle_first_dst_param="preserve").
P_src = ParamSpec("P_src")
P_dst = ParamSpec("P_dst")
R_src = TypeVar("R_src")
R_dst = TypeVar("R_dst")
First_dst = TypeVar("First_dst")


class _Module(Generic[P, R_co], Protocol):
    """Anything with a ``forward(*P) -> R_co`` (an ``nn.Module`` as the type checker sees it)."""

    def forward(self, *args: P.args, **kwargs: P.kwargs) -> R_co:
        """The module's forward."""
        ...


def apply_module(m: _Module[P, R_co], *, check_subclass: bool = True) -> Callable[P, R_co]:
    """Return ``m`` unchanged (typed as its ``forward``); ``TypeError`` if it is not an ``nn.Module``."""
    if check_subclass and not isinstance(m, torch.nn.Module):
        raise TypeError(f"{type(m)} is not a subclass of torch.nn.Module")
    return m


def not_none(value: T | None) -> T:
    """``value``, or ``ValueError`` when it is ``None`` (narrows ``Optional[T]`` to ``T``)."""
    if value is None:
        raise ValueError("Expected value to be not None")
    return value


def copy_signature(
    source: Callable[P_src, R_src],
    /,
    *,
    handle_return_type: Literal["preserve", "overwrite"] = "preserve",
    handle_first_src_param: Literal["copy", "skip"] = "copy",
    handle_first_dst_param: Literal["preserve", "drop"] = "drop",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator giving the decorated function ``source``'s signature (``inspect.signature`` sees it).

    ``handle_return_type='overwrite'`` also copies the return annotation; ``handle_first_src_param='skip'``
    leaves out ``source``'s first parameter (``self``); ``handle_first_dst_param='preserve'`` keeps the
    decorated function's own first parameter in front.
    """
    for label, value, allowed in (
        ("handle_return_type", handle_return_type, ("preserve", "overwrite")),
        ("handle_first_src_param", handle_first_src_param, ("copy", "skip")),
        ("handle_first_dst_param", handle_first_dst_param, ("preserve", "drop")),
    ):
        if value not in allowed:
            raise ValueError(f"copy_signature: {label}={value!r} must be one of {allowed}")
    src_sig = inspect.signature(source)

    def decorate(target: Callable[P_dst, R_dst], /) -> Callable[..., Any]:
        dst_sig = inspect.signature(target)
        params = []
        if handle_first_dst_param == "preserve":
            params.append(next(iter(dst_sig.parameters.values())))
        src_params = list(src_sig.parameters.values())
        params += src_params[1:] if handle_first_src_param == "skip" else src_params
        new_sig = dst_sig.replace(parameters=params)
        if handle_return_type == "overwrite":
            new_sig = new_sig.replace(return_annotation=src_sig.return_annotation)
        target.__signature__ = new_sig  # type: ignore[attr-defined]
        return target

    return decorate
