"""Deterministic-mode switches of the Mamba ops (Megatron-Core 0.19's ``ssm.ops.determinism``).

:func:`use_deterministic_mode` is, in order: the value given to :func:`set_deterministic_mode` (``None`` clears
it), the ``MAMBA_DETERMINISTIC`` environment variable (its first character ``1`` means on), then
``torch.are_deterministic_algorithms_enabled()``.

What it controls here: :func:`autotune_configs` (a kernel's autotuning candidates cut to one, chosen by the
``TRITON_AUTOTUNE_BLOCK_*`` variables or the cheapest by block size x stages, unless Triton >= 3.4 caches
autotuning under ``TRITON_CACHE_AUTOTUNING=1``) and :func:`alloc_tile_workspace` / :func:`finalize_tile_workspace`
(per-program partial sums reduced in a fixed order instead of accumulated). The ops of :mod:`megatron_core.ssm.ops`
themselves are run-to-run deterministic in both modes: their kernels have fixed block shapes (no autotuning) and
use no atomics (the PyTorch paths are deterministic wherever PyTorch's own ops are).

``TRITON_VERSION`` is read from the installed distribution's metadata, without importing Triton.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from typing import Any

import torch
from packaging import version

__all__ = ["TRITON_HAS_CACHE_RESULTS", "TRITON_VERSION", "alloc_tile_workspace", "autotune_configs",
           "finalize_tile_workspace", "set_deterministic_mode", "use_deterministic_mode"]


def _triton_version() -> version.Version:
    try:
        return version.parse(importlib.metadata.version("triton"))
    except (importlib.metadata.PackageNotFoundError, version.InvalidVersion):
        return version.parse("0.0.0")


TRITON_VERSION = _triton_version()
TRITON_HAS_CACHE_RESULTS = TRITON_VERSION >= version.parse("3.4.0")

_override: bool | None = None
_warned = False


def use_deterministic_mode() -> bool:
    """Whether the Mamba ops run deterministically (see the module's docstring for the order of the sources)."""
    if _override is not None:
        return _override
    env = os.environ.get("MAMBA_DETERMINISTIC")
    if env:
        return env[0] == "1"
    return torch.are_deterministic_algorithms_enabled()


def set_deterministic_mode(value: bool | None) -> None:
    """Force deterministic mode on or off for the Mamba ops; ``None`` goes back to the environment and torch."""
    global _override
    _override = value


def _config_cost(config: Any) -> tuple[int, int]:
    """``(product of the BLOCK* sizes x stages, warps)``: smaller is cheaper; warps break ties."""
    product = 1
    for key, value in config.kwargs.items():
        if key.startswith("BLOCK") and isinstance(value, int):
            product *= value
    return product * (getattr(config, "num_stages", 1) or 1), getattr(config, "num_warps", 1) or 1


def _configs_from_env(configs: list) -> list | None:
    """The first config matching every ``TRITON_AUTOTUNE_BLOCK_*=value`` variable (as kwarg ``BLOCK_*``), in a
    one-element list; None when no such variable is set or nothing matches."""
    prefix = "TRITON_AUTOTUNE_"
    wanted = {key[len(prefix):]: int(value) for key, value in os.environ.items()
              if key.startswith(prefix + "BLOCK") and value}
    if not wanted:
        return None
    matching = [c for c in configs if all(c.kwargs.get(k) == v for k, v in sorted(wanted.items()))]
    return matching[:1] or None


def autotune_configs(configs: list) -> list:
    """``configs`` (``triton.Config`` objects) as given outside deterministic mode; in it, one config (see the
    module's docstring), with a one-time warning on how to keep autotuning reproducible."""
    if not configs or not use_deterministic_mode():
        return configs
    if TRITON_HAS_CACHE_RESULTS and os.environ.get("TRITON_CACHE_AUTOTUNING") == "1":
        return configs
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("Deterministic mode: set TRITON_CACHE_AUTOTUNING=1 for cached autotuning."
                      if TRITON_HAS_CACHE_RESULTS else
                      "Deterministic mode: upgrade to Triton >= 3.4.0 for cached autotuning.", stacklevel=2)
    return _configs_from_env(configs) or [min(configs, key=_config_cost)]


def alloc_tile_workspace(base_shape: tuple[int, ...] | None, tile_dim: int, dtype: torch.dtype,
                         device: torch.device | str, deterministic: bool, *,
                         zero_init: bool = True) -> tuple[torch.Tensor | None, int]:
    """``(buffer, stride of its tile axis)``: deterministic, ``base_shape + (tile_dim,)`` (zeros unless
    ``zero_init`` is False) for each program to write its partial sum to; else ``base_shape`` for atomic adds and
    stride 0. ``(None, 0)`` when ``base_shape`` is None."""
    if base_shape is None:
        return None, 0
    if deterministic:
        make = torch.zeros if zero_init else torch.empty
        buffer = make(*base_shape, tile_dim, device=device, dtype=dtype)
        return buffer, buffer.stride(-1)
    return torch.empty(*base_shape, device=device, dtype=dtype), 0


def finalize_tile_workspace(tensor: torch.Tensor | None, deterministic: bool) -> torch.Tensor | None:
    """The workspace's result: the tile axis summed in deterministic mode, the buffer itself otherwise."""
    if tensor is None:
        return None
    return tensor.sum(dim=-1) if deterministic else tensor
