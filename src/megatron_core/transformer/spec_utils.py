"""``ModuleSpec`` and ``build_module``: how Megatron-Core composes layers from swappable parts.

A spec names a class (or a lazily imported ``(module_path, name)`` tuple), constructor
``params`` and optional ``submodules`` that are passed on as ``submodules=``. A spec (or a
bare object) that is a plain function is returned as is, not called: that is how function
factories such as ``get_bias_dropout_add`` fill a slot.
"""

from __future__ import annotations

import importlib
import inspect
import types
from dataclasses import dataclass, field
from functools import partial
from typing import Any


@dataclass
class ModuleSpec:
    """What to build: ``module`` (a class, function or ``(module_path, name)``), its ``params`` and ``submodules``."""

    module: type | tuple[str, str] | Any
    params: dict = field(default_factory=dict)
    submodules: Any = None
    metainfo: dict = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Same as ``build_module(self, *args, **kwargs)``."""
        return build_module(self, *args, **kwargs)


def import_module(module_path: tuple[str, str]) -> Any:
    """Import ``name`` from ``module_path`` given as a ``(module_path, name)`` tuple."""
    if not (isinstance(module_path, tuple) and len(module_path) == 2):
        raise TypeError(f"import_module expects a (module_path, name) tuple, got {module_path!r}")
    base, name = module_path
    try:
        module = importlib.import_module(base)
    except ImportError as err:
        raise ImportError(f"cannot import module '{base}' for spec {module_path!r}: {err}") from err
    try:
        return getattr(module, name)
    except AttributeError as err:
        raise ImportError(f"module '{base}' has no attribute '{name}' (spec {module_path!r})") from err


def _is_function(obj: Any) -> bool:
    return isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType))


def get_module(spec_or_module: ModuleSpec | type | tuple[str, str], **additional_kwargs: Any) -> Any:
    """The class or function a spec refers to, without building it."""
    if isinstance(spec_or_module, ModuleSpec):
        module = spec_or_module.module
    else:
        module = spec_or_module
    if isinstance(module, tuple):
        module = import_module(module)
    return module


def get_submodules(spec_or_module: Any) -> Any:
    """The ``submodules`` of a ``ModuleSpec`` (or any object with that attribute) or of a
    ``functools.partial(..., submodules=...)``.

    As in Megatron-Core: a ``partial`` without a ``submodules`` keyword raises ``KeyError``; anything else
    without ``submodules`` (a bare class or function) raises ``ValueError``.
    """
    if isinstance(spec_or_module, partial):
        return spec_or_module.keywords["submodules"]
    if hasattr(spec_or_module, "submodules"):
        return spec_or_module.submodules
    raise ValueError(f"Could not find `submodules` in the provided spec: {spec_or_module!r}")


def build_module(spec_or_module: ModuleSpec | type | tuple[str, str] | Any, *args: Any, **kwargs: Any) -> Any:
    """Build what a spec describes: ``cls(*args, **spec.params, **kwargs)`` with ``submodules=`` injected.

    Functions (bare or as ``spec.module``) are returned uncalled. Errors raised by the
    constructor are re-raised with the name of the class being built.
    """
    if _is_function(spec_or_module):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec) and _is_function(spec_or_module.module):
        return spec_or_module.module
    if spec_or_module is None:
        raise TypeError("build_module got None; a spec slot must hold a ModuleSpec, class or function")

    module = get_module(spec_or_module)
    if _is_function(module):
        return module
    if isinstance(spec_or_module, ModuleSpec):
        params = dict(spec_or_module.params)
        if spec_or_module.submodules is not None:
            kwargs["submodules"] = spec_or_module.submodules
    else:
        params = {}
    name = getattr(module, "__name__", repr(module))
    if not (inspect.isclass(module) or callable(module)):
        raise TypeError(f"cannot build {module!r}: it is neither a class nor a callable")
    try:
        return module(*args, **params, **kwargs)
    except Exception as err:
        try:
            annotated = type(err)(f"{err} when instantiating {name}")
        except Exception:
            raise err from None
        raise annotated.with_traceback(err.__traceback__) from None
