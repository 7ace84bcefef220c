"""Placeholders for optional submodules (Megatron-Core's ``IdentityOp`` / ``IdentityFuncOp``).

A ``TransformerLayerSubmodules`` field left at its default builds one of these, so a layer
without, say, a pre-MLP norm runs the same code path with a no-op in that slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged; accepts and ignores any constructor arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, x: T, *args: Any, **kwargs: Any) -> T:
        """Return ``x``."""
        return x


class IdentityFuncOp(IdentityOp):
    """A module whose forward returns the identity *function* (stands in for a function factory).

    Used where the slot is called as ``module(...)(x, ...)``, e.g. bias-dropout-add.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """Return a function that returns its first argument."""
        return _identity


def _identity(x: Any, *args: Any, **kwargs: Any) -> Any:
    return x
