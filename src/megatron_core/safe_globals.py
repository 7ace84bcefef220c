"""Classes that ``torch.load(weights_only=True)`` may rebuild, and restricted unpicklers (Megatron-Core's module).

``torch.load`` defaults to ``weights_only=True`` from PyTorch 2.6: only allow-listed globals are rebuilt.
Megatron-LM checkpoints hold a few more (an ``argparse.Namespace`` of arguments, enums, numpy arrays):
:func:`register_safe_globals` adds them to torch's allow-list. ``import megatron_core`` registers the
standard-library, numpy and torch entries and this library's light enums; the classes whose modules are
heavy to import (``OptimizerConfig``, the ``transformer.enums`` enums) are added by calling
:func:`register_safe_globals` (Megatron-Core adds all at import; docs/compat.md).

:class:`SafeUnpickler` is a ``pickle.Unpickler`` that rebuilds only plain containers, numbers, strings,
tensors and storages (what serialised FP8 extra state holds) and refuses any other class;
:func:`safe_numpy_load` runs ``numpy.load`` with that unpickler for object arrays.
"""

from __future__ import annotations

import io
import pickle
import threading
from argparse import Namespace
from pathlib import PosixPath
from signal import Signals
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import numpy
import torch

__all__ = ["SAFE_GLOBALS", "SafeUnpickler", "register_safe_globals", "safe_load_from_bytes", "safe_numpy_load"]

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct


def _light_globals() -> list[Any]:
    from numpy.dtypes import UInt32DType

    from megatron_core._rerun_parts import RerunDiagnostic, RerunMode, RerunState
    from megatron_core.enums import ModelType

    return [SimpleNamespace, PosixPath, _reconstruct, numpy.ndarray, numpy.dtype, UInt32DType, Namespace,
            ModelType, RerunDiagnostic, RerunMode, RerunState, io.BytesIO, Signals, torch._C.Generator]


SAFE_GLOBALS: list[Any] = _light_globals()
"""The globals registered by ``import megatron_core``; :func:`register_safe_globals` adds the heavy ones."""


def _register(classes: list[Any]) -> None:
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(classes)


def register_light_safe_globals() -> None:
    """Register :data:`SAFE_GLOBALS` with torch (what ``import megatron_core`` does)."""
    _register(SAFE_GLOBALS)


def register_safe_globals() -> None:
    """Register every class Megatron-Core allows: :data:`SAFE_GLOBALS`, ``OptimizerConfig`` and the attention /
    CUDA-graph enums of ``transformer.enums`` (these two imports load the transformer and optimizer packages)."""
    from megatron_core.optimizer.optimizer_config import OptimizerConfig
    from megatron_core.transformer import enums

    heavy = [OptimizerConfig, enums.AttnBackend]
    heavy += [getattr(enums, name) for name in ("CudaGraphModule", "CudaGraphScope", "InferenceCudaGraphScope")
              if hasattr(enums, name)]
    _register(SAFE_GLOBALS + heavy)


def safe_load_from_bytes(b: bytes) -> Any:
    """``torch.storage._load_from_bytes`` with ``weights_only=True``."""
    return torch.load(io.BytesIO(b), weights_only=True)


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds only plain containers, numbers, strings, tensors and storages.

    Any other global raises ``pickle.UnpicklingError`` ("Refusing to unpickle ..."), so a crafted file
    cannot run code. The allow-list is Megatron-Core's (including Transformer Engine's FP8 recipe classes,
    which FP8 extra state may hold).
    """

    _SAFE_CLASSES: frozenset = frozenset({
        *(("builtins", name) for name in ("dict", "list", "tuple", "int", "float", "bool", "bytes", "str")),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "_load_from_bytes"),
        *(("transformer_engine.common.recipe", name) for name in (
            "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
            "NVFP4BlockScaling", "Format", "_FormatHelper", "MMParams", "QParams")),
        ("megatron_core.extensions.transformer_engine", "TEDelayedScaling"),
        ("megatron_core.safe_globals", "safe_load_from_bytes"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    })

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if allow-listed, else ``pickle.UnpicklingError``."""
        if (module, name) not in self._SAFE_CLASSES:
            raise pickle.UnpicklingError(f"Refusing to unpickle disallowed class '{module}.{name}'")
        return super().find_class(module, name)


def _safe_pickle_load(file: Any, **kwargs: Any) -> Any:
    """``pickle.load`` through :class:`SafeUnpickler`."""
    return SafeUnpickler(file, **kwargs).load()


_PICKLE_PATCH_LOCK = threading.Lock()


def safe_numpy_load(path: Any, **kwargs: Any) -> Any:
    """``numpy.load`` whose pickled (object) arrays go through :class:`SafeUnpickler` (thread-safe)."""
    with _PICKLE_PATCH_LOCK, patch("pickle.load", lambda file, **kw: _safe_pickle_load(file, **kw)):
        return numpy.load(path, **kwargs)
