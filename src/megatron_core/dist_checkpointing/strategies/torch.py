"""Megatron-Core's ``dist_checkpointing.strategies.torch`` path: the ``torch_dist`` strategies and
``get_async_strategy``.

The strategies themselves live in :mod:`.torch_dist`. ``get_async_strategy("mcore")`` returns the
asynchronous-save building blocks this library provides; ``"nvrx"`` needs NVIDIA Resiliency Extension.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_core.dist_checkpointing.strategies.torch_dist import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)


def _mcore_async_modules() -> dict[str, Any]:
    from megatron_core.dist_checkpointing.strategies import filesystem_async
    from megatron_core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
    from megatron_core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )

    return {
        "AsyncCallsQueue": AsyncCallsQueue, "AsyncRequest": AsyncRequest,
        "CachedMetadataFileSystemReader": CachedMetadataFileSystemReader,
        "FileSystemWriterAsync": filesystem_async.FileSystemWriterAsync,
        "_results_queue": filesystem_async._results_queue,
        "get_write_results_queue": filesystem_async.get_write_results_queue,
    }


def _nvrx_async_modules() -> dict[str, Any]:
    base = "nvidia_resiliency_ext.checkpointing.async_ckpt"
    try:
        core = importlib.import_module(f"{base}.core")
        reader = importlib.import_module(f"{base}.cached_metadata_filesystem_reader")
        writer = importlib.import_module(f"{base}.filesystem_async")
        saver = importlib.import_module(f"{base}.state_dict_saver")
    except ImportError as error:
        raise ModuleNotFoundError(
            "A compatible `nvidia-resiliency-ext` installation is required for `async_strategy=\"nvrx\"`. "
            "Please install it or set `async_strategy` to `mcore`."
        ) from error
    return {
        "AsyncCallsQueue": core.AsyncCallsQueue, "AsyncRequest": core.AsyncRequest,
        "CachedMetadataFileSystemReader": reader.CachedMetadataFileSystemReader,
        "CheckpointMetadataCache": saver.CheckpointMetadataCache,
        "FileSystemWriterAsync": writer.FileSystemWriterAsync, "_results_queue": writer._results_queue,
        "get_write_results_queue": writer.get_write_results_queue,
        "save_state_dict_async_finalize": saver.save_state_dict_async_finalize,
        "save_state_dict_async_plan": saver.save_state_dict_async_plan,
    }


class UnsupportedAsyncStrategyError(TypeError, ValueError):
    """An async strategy name other than ``nvrx`` / ``mcore``: Megatron-Core raises ``TypeError``, our config rule
    ``ValueError``; both catch it."""


def get_async_strategy(async_strategy: str = "nvrx", module: str | None = None) -> tuple[str, Any]:
    """``(strategy name, modules)``: a dict of async-checkpoint classes, or the one named ``module``."""
    if async_strategy == "nvrx":
        modules = _nvrx_async_modules()
    elif async_strategy == "mcore":
        modules = _mcore_async_modules()
    else:
        raise UnsupportedAsyncStrategyError(
            f"async_strategy {async_strategy} is not supported. Available strategies: nvrx, mcore.")
    if module is None:
        return async_strategy, modules
    if module not in modules:
        raise KeyError(f"async strategy {async_strategy!r} has no {module!r}; it provides {sorted(modules)}")
    return async_strategy, modules[module]


__all__ = ["TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy", "get_async_strategy"]
