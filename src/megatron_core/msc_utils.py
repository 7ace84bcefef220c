"""Optional Multi-Storage Client (``multistorageclient``) with a local-filesystem fallback.

``maybe_msc.open`` / ``.os`` / ``.Path`` / ``.torch`` are the MSC package's when it is installed and
``MultiStorageClientFeature`` is enabled, else Python's ``open``, ``os``, ``pathlib.Path`` and ``torch``
(Megatron-Core's ``msc_utils``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

_MSC_UNSET = object()
_msc: Any = _MSC_UNSET


def _msc_package() -> Any:
    """The ``multistorageclient`` module, or ``None`` when it is not installed (imported once, lazily)."""
    global _msc
    if _msc is _MSC_UNSET:
        try:
            _msc = importlib.import_module("multistorageclient")
        except ModuleNotFoundError:
            _msc = None
    return _msc


class _FeatureFlag:
    """On/off switch for MSC; enabled only counts when the package is installed."""

    def __init__(self, default: bool = False) -> None:
        self._enabled = default

    def enable(self) -> None:
        """Turn MSC on (still off when the package is missing)."""
        self._enabled = True

    def disable(self) -> None:
        """Turn MSC off."""
        self._enabled = False

    def is_enabled(self) -> bool:
        """True when switched on and ``multistorageclient`` is importable."""
        return self._enabled and _msc_package() is not None

    def import_package(self) -> Any:
        """The ``multistorageclient`` module; ``RuntimeError`` when missing or switched off."""
        if _msc_package() is None:
            raise RuntimeError("multistorageclient is not installed: pip install multi-storage-client")
        if not self.is_enabled():
            raise RuntimeError("The MSC feature is disabled: call MultiStorageClientFeature.enable()")
        return _msc_package()

    def __getstate__(self) -> dict:
        return {"_enabled": self._enabled}

    def __setstate__(self, state: dict) -> None:
        self._enabled = state["_enabled"]


MultiStorageClientFeature = _FeatureFlag(default=False)

_LOCAL = {"open": lambda: open, "os": lambda: os, "Path": lambda: importlib.import_module("pathlib").Path,
          "torch": lambda: importlib.import_module("torch")}


class MaybeMultiStorageClient:
    """Proxy to ``multistorageclient`` when enabled, else to the local-filesystem equivalents."""

    def path_isdir(self, path: Any, strict: bool = True) -> bool:
        """Whether ``path`` is a directory (MSC: committed metadata only when ``strict``)."""
        if MultiStorageClientFeature.is_enabled():
            return MultiStorageClientFeature.import_package().os.path.isdir(path, strict=strict)
        return os.path.isdir(path)

    def __getattr__(self, name: str) -> Any:
        if MultiStorageClientFeature.is_enabled():
            package = MultiStorageClientFeature.import_package()
            if hasattr(package, name):
                return getattr(package, name)
        if name in _LOCAL:
            return _LOCAL[name]()
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        names = set(_LOCAL)
        if MultiStorageClientFeature.is_enabled():
            names.update(dir(MultiStorageClientFeature.import_package()))
        return sorted(names)


maybe_msc = MaybeMultiStorageClient()

__all__ = ["MultiStorageClientFeature", "maybe_msc"]
