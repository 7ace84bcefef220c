"""Maximal update parametrisation (muP): the ``TransformerConfig`` fields it derives (Megatron-Core 0.19's rules).

With ``use_mup`` the width multiplier is ``m = hidden_size / mup_base_hidden_size`` (the base defaults to
``hidden_size``, so ``m = 1``); an unset ``softmax_scale`` becomes ``sqrt(mup_base_head_dim or 1) /
kv_channels ** mup_attn_scale_power``; a ``mup_output_mult`` left at 1 becomes ``1 / m``; hidden weights start
from ``N(0, init_method_std^2 / m)`` and the output projections from ``N(0, init_method_std^2 / (2 L m))``, while
the embeddings (and an untied output layer) keep ``init_method_std``. The optimizer side is
:func:`megatron_core.optimizer.get_mup_config_overrides`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from megatron_core._ground import init_method_normal, mup_scaled_init_method_normal

__all__ = ["apply_mup_config", "mup_init_methods"]


def _positive_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value > 0)


def apply_mup_config(cfg: Any) -> None:
    """Validate the ``mup_*`` fields and derive ``mup_base_hidden_size``, ``mup_width_mult``, ``softmax_scale``
    and ``mup_output_mult`` when ``cfg.use_mup`` (a no-op otherwise). Call after ``kv_channels`` is derived and
    before the init methods are."""
    if not cfg.use_mup:
        return
    if cfg.mup_base_hidden_size is None:
        cfg.mup_base_hidden_size = cfg.hidden_size
    if not _positive_number(cfg.mup_base_hidden_size):
        raise ValueError(f"mup_base_hidden_size ({cfg.mup_base_hidden_size!r}) must be positive when use_mup=True")
    if cfg.mup_base_head_dim is not None and not _positive_number(cfg.mup_base_head_dim):
        raise ValueError(f"mup_base_head_dim ({cfg.mup_base_head_dim!r}) must be positive (or None) when "
                         "use_mup=True: the softmax scale is sqrt(mup_base_head_dim) / kv_channels ** power")
    for name in ("mup_attn_scale_power", "mup_embedding_mult", "mup_output_mult"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} ({value!r}) must be a finite number when use_mup=True")
    cfg.mup_width_mult = cfg.hidden_size / cfg.mup_base_hidden_size
    if cfg.softmax_scale is None:
        base = 1.0 if cfg.mup_base_head_dim is None else math.sqrt(cfg.mup_base_head_dim)
        cfg.softmax_scale = base / (cfg.kv_channels ** cfg.mup_attn_scale_power)
    if cfg.mup_output_mult == 1.0 and cfg.mup_width_mult != 1.0:
        cfg.mup_output_mult = 1.0 / cfg.mup_width_mult
    custom = [name for name in ("init_method", "output_layer_init_method") if getattr(cfg, name) is not None]
    if custom:
        warnings.warn(f"use_mup=True with a custom {' and '.join(custom)}: muP's width-scaled initialisation is "
                      "not applied to it", UserWarning, stacklevel=3)


def mup_init_methods(cfg: Any) -> None:
    """Fill the unset init methods the muP way (see the module docstring); ``cfg.use_mup`` must be True."""
    if cfg.embedding_init_method is None:
        std = cfg.embedding_init_method_std if cfg.embedding_init_method_std is not None else cfg.init_method_std
        cfg.embedding_init_method = init_method_normal(std)
    if cfg.init_method is None:
        cfg.init_method = init_method_normal(cfg.init_method_std / math.sqrt(cfg.mup_width_mult))
    if cfg.output_layer_init_method is None:
        cfg.output_layer_init_method = mup_scaled_init_method_normal(
            cfg.init_method_std, cfg.num_layers, cfg.mup_width_mult, multiplier=1.0 if cfg.is_hybrid_model else 2.0)
