"""Megatron-Core's ``fp8_utils`` names that training code calls around FP8 checkpoints.

This library's FP8 training (:mod:`megatron_core.fp8`) either keeps no amax history (torchao's dynamic
recipes) or, with ``fp8_recipe='delayed'``, restores its histories exactly from each layer's
``_extra_state`` (no checkpoint-load copy writes into them), so the Transformer Engine 1.x repair of amax
histories after a checkpoint load has nothing to do here; Megatron-Core's own function does nothing either
with Transformer Engine 2 or without it.

The FP8-parameter helpers Megatron-Core's distributed optimizer calls (``is_float8tensor``,
``dequantize_fp8_tensor``, ``quantize_param_shard``, ``copy_tensor_to_quantized_param``) are those of
:mod:`megatron_core.distributed.fp8_params`, for this library's FP8 parameters (``fp8_param``: tensorwise scales
for the dense layers, row-wise for the MoE experts' grouped weights).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from megatron_core.distributed.fp8_params import (
    copy_tensor_to_quantized_param,
    dequantize_fp8_tensor,
    quantize_param_shard,
)
from megatron_core.distributed.fp8_params import is_fp8_param as is_float8tensor

__all__ = ["copy_tensor_to_quantized_param", "correct_amax_history_if_needed", "dequantize_fp8_tensor",
           "get_fp8_context", "is_float8tensor", "quantize_param_shard"]


def get_fp8_context(config: Any, layer_no: int = -1, is_init: bool = False) -> AbstractContextManager:
    """The context Megatron-Core enters around a layer's forward (``is_init=False``) or construction.

    Always a ``nullcontext()`` here, as in Megatron-Core without Transformer Engine: this library's FP8
    GEMMs are chosen when the layers are built (``megatron_core.fp8``, from ``config.fp8`` and the
    first/last BF16 layers), not by a surrounding autocast.
    """
    return nullcontext()


def correct_amax_history_if_needed(model: list[torch.nn.Module] | torch.nn.Module) -> None:
    """Repair FP8 amax histories after loading a checkpoint (Megatron-Core's call); a no-op in this library,
    whose delayed-scaling histories load exactly from ``_extra_state``. ``TypeError`` unless given a module or a list of modules."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"correct_amax_history_if_needed expects torch.nn.Module chunks, got {type(chunk).__name__}")
