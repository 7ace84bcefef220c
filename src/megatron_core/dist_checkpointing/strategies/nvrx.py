"""Helpers for NVIDIA Resiliency Extension's (NVRx) asynchronous checkpointing, an optional dependency.

Nothing here imports ``nvidia_resiliency_ext`` at module import time: :func:`has_nvrx_async_support`
tries its async-checkpoint modules when called and answers False when they are missing.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from packaging.version import Version

NVRX_MIN_VERSION = "0.6.0"

_ASYNC_CKPT = "nvidia_resiliency_ext.checkpointing.async_ckpt"
_REQUIRED_SYMBOLS = {
    "core": ("AsyncCallsQueue", "AsyncRequest"),
    "cached_metadata_filesystem_reader": ("CachedMetadataFileSystemReader",),
    "filesystem_async": ("FileSystemWriterAsync", "get_write_results_queue"),
    "state_dict_saver": ("CheckpointMetadataCache", "save_state_dict_async_finalize", "save_state_dict_async_plan"),
}


def has_nvrx_async_support() -> bool:
    """Whether NVRx's async-checkpoint modules and every symbol Megatron-Core uses from them are importable.

    False when a module is missing; ``AssertionError`` when they are present but NVRx is older than
    :data:`NVRX_MIN_VERSION`.
    """
    try:
        modules = {name: import_module(f"{_ASYNC_CKPT}.{name}") for name in _REQUIRED_SYMBOLS}
    except ImportError:
        return False
    assert is_nvrx_min_version(), f"Minimum required nvidia-resiliency-ext package version is {NVRX_MIN_VERSION}."
    present = all(getattr(modules[m], s, None) is not None for m, names in _REQUIRED_SYMBOLS.items() for s in names)
    return present and hasattr(modules["filesystem_async"], "_results_queue")


def make_nvrx_async_request(async_request_cls: type, async_fn: Callable[..., Any], async_fn_args: Any,
                            finalize_fns: list[Callable[..., Any]], async_fn_kwargs: dict[str, Any] | None = None,
                            preload_fn: Callable[..., Any] | None = None) -> Any:
    """An instance of NVRx's ``AsyncRequest`` class ``async_request_cls`` built with NVRx's keyword names."""
    return async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=async_fn_kwargs or {},
                             preload_fn=preload_fn)


def is_nvrx_min_version(version: str = NVRX_MIN_VERSION) -> bool:
    """Whether the installed nvidia-resiliency-ext is at least ``version`` (False when it is not installed)."""
    try:
        nvrx = import_module("nvidia_resiliency_ext")
    except ImportError:
        return False
    return Version(str(getattr(nvrx, "__version__", "0.0.0"))) >= Version(version)


__all__ = ["NVRX_MIN_VERSION", "has_nvrx_async_support", "is_nvrx_min_version", "make_nvrx_async_request"]
