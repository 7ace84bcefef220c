"""The one place NVML (NVIDIA Management Library) is imported: module ``pynvml`` of ``nvidia-ml-py``.

NVML is optional. :func:`open_current_device` starts NVML and returns the handle of this process's
current CUDA device, found by its UUID, so a device renumbered by ``CUDA_VISIBLE_DEVICES`` still
maps to the right GPU (NVML's own indices ignore that variable). A missing ``pynvml`` raises
``ImportError`` naming the package; no CUDA device, no NVIDIA driver or an unknown UUID raise
``RuntimeError`` saying which. :func:`ideal_cpu_set` decodes NVML's CPU-affinity bitmask.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import uuid
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from megatron_core.device import cuda_available

NVML_MISSING = (
    "{what} needs the NVML Python bindings (module 'pynvml'), which are not installed: "
    "pip install nvidia-ml-py (or the 'nvml' extra)"
)

BITS_PER_MASK_WORD = ctypes.sizeof(ctypes.c_ulong) * 8
"""Bits in one word of NVML's CPU mask (a C ``unsigned long``: 64 on 64-bit Linux)."""


def import_nvml(what: str) -> ModuleType:
    """The ``pynvml`` module, or ``ImportError`` saying that ``what`` needs ``nvidia-ml-py``."""
    try:
        return importlib.import_module("pynvml")
    except ImportError as error:
        raise ImportError(NVML_MISSING.format(what=what)) from error


def current_device_uuid(what: str) -> str:
    """NVML's UUID string (``GPU-xxxxxxxx-...``) of the current CUDA device; ``RuntimeError`` without one."""
    if not cuda_available():
        raise RuntimeError(f"{what} needs a CUDA device, but torch.cuda.is_available() is False")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"GPU-{uuid.UUID(bytes=bytes(props.uuid.bytes))}"


def open_current_device(what: str) -> tuple[ModuleType, Any]:
    """Start NVML; return ``(pynvml, handle of the current CUDA device)``.

    Each successful call must be paired with one ``pynvml.nvmlShutdown()`` (NVML counts them).
    """
    nvml = import_nvml(what)
    device_uuid = current_device_uuid(what)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise RuntimeError(f"{what} could not start NVML ({error}); is the NVIDIA driver installed?") from error
    try:
        return nvml, nvml.nvmlDeviceGetHandleByUUID(device_uuid)
    except nvml.NVMLError as error:
        nvml.nvmlShutdown()
        raise RuntimeError(f"{what}: NVML finds no device with UUID {device_uuid} ({error})") from error


def cpu_set_from_mask(words: Iterable[int], bits_per_word: int = BITS_PER_MASK_WORD) -> set[int]:
    """CPU ids whose bits are set in ``words`` (bit ``b`` of word ``w`` is CPU ``w * bits_per_word + b``)."""
    return {w * bits_per_word + b for w, word in enumerate(words) for b in range(bits_per_word) if int(word) >> b & 1}


def ideal_cpu_set(nvml: ModuleType, handle: Any) -> set[int]:
    """The CPUs NVML names as closest to the device ``handle`` (its NUMA node's CPUs)."""
    highest = max([os.cpu_count() or 1, *(cpu + 1 for cpu in os.sched_getaffinity(0))])
    n_words = -(-highest // BITS_PER_MASK_WORD)
    return cpu_set_from_mask(nvml.nvmlDeviceGetCpuAffinity(handle, n_words))
