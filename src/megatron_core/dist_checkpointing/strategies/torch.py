"""Megatron-Core's ``dist_checkpointing.strategies.torch`` path: the ``torch_dist`` strategies,
``get_async_strategy`` and the DCP translation helpers.

The strategies themselves live in :mod:`.torch_dist`; the translation of sharded state dicts for
``torch.distributed.checkpoint`` and its planners in :mod:`.mcore_dcp`; the classes older megatron-core
releases pickled into ``.metadata`` (``MCoreMetadata``, ``MCoreSavePlan``) in :mod:`..safe_load`.
``get_async_strategy("mcore")`` returns the asynchronous-save building blocks this library provides;
``"nvrx"`` needs NVIDIA Resiliency Extension (:data:`HAVE_NVRX`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from megatron_core.dist_checkpointing.safe_load import MCoreMetadata, MCoreSavePlan
from megatron_core.dist_checkpointing.strategies.mcore_dcp import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
)
from megatron_core.dist_checkpointing.strategies.nvrx import has_nvrx_async_support
from megatron_core.dist_checkpointing.strategies.torch_dist import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

logger = logging.getLogger(__name__)

HAVE_NVRX = has_nvrx_async_support()
"""Whether NVIDIA Resiliency Extension's async checkpointing (``async_strategy="nvrx"``) is usable."""

MSC_PREFIX = "msc://"
"""URL prefix of Multi-Storage Client paths (see :mod:`megatron_core.msc_utils`)."""


def _mcore_async_modules() -> dict[str, Any]:
    from megatron_core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
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
        "save_state_dict_async_finalize": state_dict_saver.save_state_dict_async_finalize,
        "save_state_dict_async_plan": state_dict_saver.save_state_dict_async_plan,
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
    logger.debug("async checkpointing modules of %r: %s", async_strategy, sorted(modules))
    if module is None:
        return async_strategy, modules
    if module not in modules:
        raise KeyError(f"async strategy {async_strategy!r} has no {module!r}; it provides {sorted(modules)}")
    return async_strategy, modules[module]


__all__ = ["HAVE_NVRX", "MCoreLoadPlanner", "MCoreMetadata", "MCoreSavePlan", "MCoreSavePlanner", "MSC_PREFIX",
           "TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy", "flatten_state_dict", "get_async_strategy",
           "mcore_to_pyt_state_dict", "sharded_tensor_to_torch_sharded_tensor"]
