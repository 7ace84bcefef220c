"""megatron_core: Megatron-Core's building blocks for large-scale transformer training, installable with pip.

Subpackages are imported on first use, so ``import megatron_core`` is cheap and never fails
because an optional backend (Transformer Engine, flash-attn, tokenizer libraries) is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_core import parallel_state, safe_globals
from megatron_core.package_info import (
    __contact_emails__,
    __contact_names__,
    __description__,
    __download_url__,
    __homepage__,
    __keywords__,
    __license__,
    __package_name__,
    __repository_url__,
    __shortversion__,
    __version__,
)
from megatron_core.safe_globals import register_safe_globals, safe_load_from_bytes

# As Megatron-Core does at import: torch.load(weights_only=True) may rebuild what Megatron checkpoints hold.
safe_globals.register_light_safe_globals()

mpu = parallel_state

_SUBMODULES = (
    "config",
    "device",
    "utils",
    "process_groups_config",
    "tensor_parallel",
    "pipeline_parallel",
    "transformer",
    "models",
    "distributed",
    "optimizer",
    "dist_checkpointing",
    "datasets",
    "rerun_state_machine",
    "tokenizers",
)

# Top-level names Megatron-Core exports, resolved lazily: name -> (module, attribute).
_LAZY_NAMES = {
    "DistributedDataParallel": ("megatron_core.distributed", "DistributedDataParallel"),
    "ModelParallelConfig": ("megatron_core.model_parallel_config", "ModelParallelConfig"),
    "Timers": ("megatron_core.timers", "Timers"),
    "InferenceParams": ("megatron_core.inference_params", "InferenceParams"),
    "is_torch_min_version": ("megatron_core.utils", "is_torch_min_version"),
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"megatron_core.{name}")
    if name in _LAZY_NAMES:
        module, attribute = _LAZY_NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'megatron_core' has no attribute '{name}'")


__all__ = ["__contact_emails__", "__contact_names__", "__description__", "__download_url__", "__homepage__",
           "__keywords__", "__license__", "__package_name__", "__repository_url__", "__shortversion__", "__version__",
           "mpu", "parallel_state", "register_safe_globals", "safe_globals", "safe_load_from_bytes", *_SUBMODULES,
           *_LAZY_NAMES]
