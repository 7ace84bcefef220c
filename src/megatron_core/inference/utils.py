"""Small helpers of the inference engines (Megatron-Core's ``inference.utils``).

``Counter`` hands out request ids; ``InferenceMode`` is the process-wide "an engine is using the model"
flag the engines set; ``get_attention_mask``, ``tensor_swap``, ``device_memory_summary`` and
``await_process_call`` are one-rule utilities; ``set_decode_expert_padding`` and ``set_moe_metadata_sync``
switch a model's MoE layers between prefill and fixed-shape decode; ``check_flashinfer_jit_cache_installed``
tells whether FlashInfer's precompiled kernels are installed (this library never needs them).

The MoE layers of a model are found once and kept in ``moe_layer_cache`` (as in Megatron-Core); unlike
there, passing another model rebuilds the cache instead of reusing the first model's layers.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import weakref
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from megatron_core._ground.inference_mode import InferenceMode
from megatron_core._wrapped_model import get_model_config
from megatron_core.device import get_current_device

logger = logging.getLogger(__name__)

__all__ = ["FLASHINFER_JIT_CACHE_VERSION", "Counter", "InferenceMode", "await_process_call",
           "check_flashinfer_jit_cache_installed", "device_memory_summary", "get_attention_mask", "moe_layer_cache",
           "set_decode_expert_padding", "set_moe_metadata_sync", "tensor_swap"]

try:
    FLASHINFER_JIT_CACHE_VERSION: str | None = version("flashinfer-jit-cache")
except PackageNotFoundError:
    FLASHINFER_JIT_CACHE_VERSION = None


class Counter:
    """Hands out consecutive integers from ``start`` (``next(counter)``): the engines' request ids."""

    def __init__(self, start: int = 0) -> None:
        self.counter = start

    def __next__(self) -> int:
        value = self.counter
        self.counter += 1
        return value

    def reset(self) -> None:
        """Start again from 0."""
        self.counter = 0


def get_attention_mask(seq_length: int) -> torch.Tensor:
    """Causal mask ``[1, 1, s, s]`` on the current device: True where a query must not see a key (the future)."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=get_current_device()).triu(1).view(
        1, 1, seq_length, seq_length)


def tensor_swap(x: torch.Tensor, src_idxs: torch.Tensor, dst_idxs: torch.Tensor) -> None:
    """Swap the rows ``x[src_idxs]`` and ``x[dst_idxs]`` in place."""
    x[dst_idxs], x[src_idxs] = x[src_idxs], x[dst_idxs]


def device_memory_summary() -> str:
    """One line of the current GPU's memory use (MiB): allocated, in private pools (CUDA graphs), reserved but
    unallocated, reserved, and used on the device. ``RuntimeError`` without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("device_memory_summary needs a CUDA device")
    device = torch.cuda.current_device()
    stats = torch.cuda.memory_stats(device)
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # torch before 2.11 has no include_traces
        segments = torch.cuda.memory_snapshot()
    private = sum(s.get("active_size", 0) for s in segments
                  if s.get("device", device) == device and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    free, total = torch.cuda.mem_get_info(device)
    mib = 1024**2
    return (f"alloc={allocated / mib:.0f}MiB private={private / mib:.0f}MiB "
            f"resv-alloc={(reserved - allocated) / mib:.0f}MiB resv={reserved / mib:.0f}MiB "
            f"dev_mem={(total - free) / mib:.0f}MiB")


async def await_process_call(call: Callable[[float], Any], process: multiprocessing.Process,
                             timeout: float = 1.0) -> None:
    """Wait until ``call(timeout)`` returns true (e.g. ``event.wait``, ``pipe.poll``), checking every ``timeout``
    seconds that ``process`` is still alive; ``RuntimeError`` naming it once it has exited."""
    while True:
        if await asyncio.to_thread(call, timeout):
            return
        if not process.is_alive():
            raise RuntimeError(f"Process {process.name} (pid {process.pid}) has exited unexpectedly.")


moe_layer_cache: list[Any] | None = None
# The models the cache and the metadata-sync flags were made for, held weakly: a model's ``id`` can be reused by a
# later one once it is freed, which would then be taken for the earlier model.
_moe_cache_model: weakref.ref | None = None
_moe_metadata_sync_model: weakref.ref | None = None


def _is_model(ref: weakref.ref | None, model: torch.nn.Module) -> bool:
    return ref is not None and ref() is model


def _init_moe_expert_cache(model: torch.nn.Module) -> None:
    """Fill ``moe_layer_cache`` with ``model``'s MoE layers (module order), once per model."""
    from megatron_core.transformer.moe.moe_layer import MoELayer

    global moe_layer_cache, _moe_cache_model
    if moe_layer_cache is not None and _is_model(_moe_cache_model, model):
        return
    moe_layer_cache = [m for m in model.modules() if isinstance(m, MoELayer)]
    _moe_cache_model = weakref.ref(model)


def set_moe_metadata_sync(model: torch.nn.Module) -> None:
    """Let only the first MoE layer's inference dispatcher (``_inference_token_dispatcher``) run the per-step
    metadata collective (``_runs_metadata_sync``); the others skip it. Once per model, after it is built."""
    global _moe_metadata_sync_model
    if _is_model(_moe_metadata_sync_model, model):
        return
    _init_moe_expert_cache(model)
    for index, layer in enumerate(moe_layer_cache):
        dispatcher = getattr(layer, "_inference_token_dispatcher", None)
        if dispatcher is not None:
            dispatcher._runs_metadata_sync = index == 0
    _moe_metadata_sync_model = weakref.ref(model)


_DROPLESS_METADATA = ("input_splits", "output_splits", "output_splits_tp", "tokens_per_expert",
                      "num_global_tokens_per_local_expert", "reversed_local_input_permutation_mapping", "capacity")


def set_decode_expert_padding(model: torch.nn.Module, set_to: bool = False, capacity_factor: float | None = None
                              ) -> None:
    """Switch ``model``'s MoE layers to drop-and-pad routing (``set_to``), so decode steps have fixed shapes.

    Sets ``moe_pad_expert_input_to_capacity`` and ``moe_expert_capacity_factor`` on the model's config, every
    router's and dispatcher's config, and each dispatcher's ``drop_and_pad``; switching on also clears the
    variable-size metadata a dropless prefill left on the dispatchers. ``capacity_factor = num_moe_experts /
    moe_router_topk`` pads without dropping any token.
    """
    _init_moe_expert_cache(model)
    pad = bool(set_to)
    configs = [get_model_config(model)]
    for layer in moe_layer_cache:
        dispatcher, router = layer.token_dispatcher, layer.router
        dispatcher.drop_and_pad = pad
        dispatcher.moe_expert_capacity_factor = capacity_factor
        router.moe_expert_capacity_factor = capacity_factor
        configs += [getattr(dispatcher, "config", None), getattr(router, "config", None)]
        if pad:
            for name in _DROPLESS_METADATA:
                if hasattr(dispatcher, name):
                    setattr(dispatcher, name, None)
            if hasattr(dispatcher, "cuda_sync_point"):
                dispatcher.cuda_sync_point = "no_sync"
    for config in configs:
        if config is not None:
            config.moe_pad_expert_input_to_capacity = pad
            config.moe_expert_capacity_factor = capacity_factor


def check_flashinfer_jit_cache_installed(log_version: bool = False) -> None:
    """Return when ``flashinfer-jit-cache`` (FlashInfer's precompiled CUTLASS MoE kernels) is installed, else
    raise ``RuntimeError`` with the install command for this torch's CUDA major version."""
    if FLASHINFER_JIT_CACHE_VERSION is not None:
        if log_version:
            logger.info("Found flashinfer-jit-cache %s with pre-compiled CUTLASS kernels.",
                        FLASHINFER_JIT_CACHE_VERSION)
        return
    cuda_major = torch.version.cuda.split(".")[0] if torch.version.cuda else None
    wheels = {"12": "cu129", "13": "cu130"}
    install = (f"Install it with:\n\npip install flashinfer-jit-cache --index-url "
               f"https://flashinfer.ai/whl/{wheels[cuda_major]}\n" if cuda_major in wheels else "")
    raise RuntimeError("The 'flashinfer-jit-cache' package is required for expert parallel inference "
                       f"but is not installed. {install}")
