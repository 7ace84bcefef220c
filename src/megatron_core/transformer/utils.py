"""Megatron-Core's ``transformer.utils`` helpers: sharded-state-dict builders (defined in
``dist_checkpointing.sharded_module``) and small attention-mask helpers."""

from __future__ import annotations

import torch

from megatron_core.dist_checkpointing.sharded_module import (
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)


def get_linear_layer(rows: int, columns: int, init_method, perform_initialization: bool = True) -> torch.nn.Linear:
    """A ``torch.nn.Linear(rows -> columns)`` whose weight is set by ``init_method`` and bias zeroed."""
    layer = torch.nn.Linear(rows, columns)
    if perform_initialization:
        init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Fill masked positions (``attention_mask`` True) of ``attention_scores`` with -10000, in place."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


__all__ = ["attention_mask_func", "get_linear_layer", "make_sharded_tensors_for_checkpoint",
           "sharded_state_dict_default"]
