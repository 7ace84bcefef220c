"""What an FP8-parameter layer (``fp8_param``) does differently from its high-precision parent as a module.

:func:`apply_keeping_fp8_params` is the layers' ``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.bfloat16()``,
``Float16Module``): an FP8 parameter keeps its bytes and scales; it follows the device, and a floating-point cast
sets its high-precision dtype (of its gradient and checkpointed value). Shared by the dense FP8 layers
(:mod:`megatron_core.fp8.layers`) and the experts' grouped ones (:mod:`megatron_core.fp8.grouped_layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.distributed.fp8_params import is_fp8_param

__all__ = ["apply_keeping_fp8_params"]


def apply_keeping_fp8_params(module: torch.nn.Module, parent_apply: Callable[..., Any], fn: Any,
                             recurse: bool = True) -> Any:
    """``parent_apply(fn, recurse)`` on ``module`` with its FP8 parameters set aside, then moved to ``fn``'s device
    (bytes and scales unchanged) and given ``fn``'s floating-point dtype as their high-precision dtype."""
    names = list(module._parameters)
    fp8 = {n: p for n, p in module._parameters.items() if is_fp8_param(p)}
    for name in fp8:
        del module._parameters[name]
    try:
        result = parent_apply(fn, recurse)
    finally:
        params = [(n, fp8[n] if n in fp8 else module._parameters[n]) for n in names]
        module._parameters.clear()
        module._parameters.update(params)
    for param in fp8.values():
        probe = fn(torch.empty(0, dtype=param.fp8_hp_dtype, device=param.device))
        if probe.device != param.device:
            param.data = param.data.to(probe.device)
            param.fp8_scale = param.fp8_scale.to(probe.device)
            param.__dict__.pop("fp8_transpose", None)  # reallocated on the new device at the next step's start
        if probe.dtype.is_floating_point:
            param.fp8_hp_dtype = probe.dtype
    return result
