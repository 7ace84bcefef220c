"""The one place Transformer Engine (TE) is imported, and lazily-bound TE subclasses.

Megatron's wrappers subclass TE's modules (``TELinear(te.pytorch.Linear)``). TE is optional here,
so a wrapper class is defined against :class:`LazyTEModule` and becomes a real subclass of the
TE module on first instantiation: ``TELinear(...)`` builds (once) ``type("TELinear", (TELinear,
te.pytorch.Linear), {})`` and returns an instance of it, so ``isinstance(x, TELinear)`` and
``isinstance(x, te.pytorch.Linear)`` both hold. Without TE the instantiation raises
``ImportError`` naming the ``te`` extra.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from typing import Any

TE_MISSING = (
    "{what} needs NVIDIA Transformer Engine, which is not installed: pip install 'megatron-core-lite[te]' "
    "(or build the model with the local layer spec, get_gpt_layer_local_spec())"
)

HAVE_TE: bool = importlib.util.find_spec("transformer_engine") is not None
"""Whether Transformer Engine is installed (found on the path; it is imported only when used)."""


def import_te(what: str = "this layer") -> Any:
    """The ``transformer_engine`` package (with ``.pytorch`` loaded), or ``ImportError`` naming the extra."""
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except ImportError as error:
        raise ImportError(TE_MISSING.format(what=what)) from error
    return te


def te_attr(te: Any, dotted: str) -> Any:
    """``te.<dotted>``, e.g. ``te_attr(te, "pytorch.Linear")``."""
    obj = te
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@cache
def _bound(cls: type) -> type:
    base = te_attr(import_te(cls.__name__), cls.te_base)
    return type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                             "_te_bound": True})


class LazyTEModule:
    """Base of the wrappers: names its TE base class (``te_base``) and binds to it on first use."""

    te_base: str = ""
    _te_bound: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls._te_bound:
            bound = _bound(cls)
            return bound.__new__(bound, *args, **kwargs)
        return super().__new__(cls)
