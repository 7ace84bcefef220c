"""Registries that let a lower layer handle classes defined above it, without importing them.

``unwrap_model`` strips the wrappers (DDP, FSDP, Float16Module, ...) that keep a model in
``.module``: wrapper classes register themselves with :func:`register_wrapper` where they are
defined, so this ground module knows no wrapper and the one implementation serves every layer.
PyTorch's own ``FullyShardedDataParallel`` is registered here (it is not ours). Code that looks
through wrappers another way (for an attribute, or past every ``.module``) walks :func:`module_chain`.

FSDP units: model classes that become their own FSDP2 unit by default (``TransformerLayer``,
``LanguageModelEmbedding``) register with :func:`register_fsdp_unit`; ``TorchFullyShardedDataParallel``
uses them when its caller passes no ``sub_modules_to_wrap``.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import takewhile
from typing import Any, TypeVar

T = TypeVar("T", bound=type)

_WRAPPERS: list[type] = []
_FSDP_UNITS: list[type] = []


def register_fsdp_unit(cls: T) -> T:
    """Class decorator: modules of ``cls`` are FSDP2 units unless the caller names its own."""
    if cls not in _FSDP_UNITS:
        _FSDP_UNITS.append(cls)
    return cls


def fsdp_unit_types() -> tuple[type, ...]:
    """The classes registered with :func:`register_fsdp_unit`."""
    return tuple(_FSDP_UNITS)


def register_wrapper(cls: T) -> T:
    """Class decorator: instances of ``cls`` are wrappers that :func:`unwrap_model` strips by default."""
    if cls not in _WRAPPERS:
        _WRAPPERS.append(cls)
    return cls


def wrapper_types() -> tuple[type, ...]:
    """The registered wrapper classes."""
    return tuple(_WRAPPERS)


def module_chain(model: Any) -> Iterator[Any]:
    """``model`` and the modules it wraps, outermost first: a wrapper keeps the module it wraps in ``.module``."""
    while True:
        yield model
        if not hasattr(model, "module"):
            return
        model = model.module


def unwrap_model(model: Any, module_instances: type | tuple[type, ...] | None = None) -> Any:
    """Strip wrappers (default: the registered ones) from a model or a list of model chunks.

    Follows ``.module`` while the object is an instance of ``module_instances``; a list in gives a list out.
    """
    if module_instances is None:
        module_instances = wrapper_types()
    chunks = model if isinstance(model, list) else [model]
    unwrapped = [next(m for m in module_chain(chunk) if not isinstance(m, module_instances)) for chunk in chunks]
    return unwrapped if isinstance(model, list) else unwrapped[0]


def wrapper_depth(model: Any) -> int:
    """How many registered wrappers :func:`unwrap_model` strips from ``model``; each adds ``module.`` to
    the keys of the state dict."""
    return sum(1 for _ in takewhile(lambda m: isinstance(m, wrapper_types()), module_chain(model)))


try:
    from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP

    register_wrapper(_TorchFSDP)
except ImportError:  # pragma: no cover - torch without FSDP
    pass
