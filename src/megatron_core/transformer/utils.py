"""Megatron-Core's ``transformer.utils`` helpers: sharded-state-dict builders (defined in
``dist_checkpointing.sharded_module``), attention masks and GeLU variants."""

from __future__ import annotations

import torch

from megatron_core import device as _device
from megatron_core.dist_checkpointing.sharded_module import (
    make_sharded_object_for_checkpoint,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron_core.jit import jit_fuser


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


def get_default_causal_mask(sq: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[sq, sq]`` bool mask, True above the diagonal (the positions a causal query must not see)."""
    device = device or _device.get_current_device()
    return torch.triu(torch.ones(sq, sq, device=device), diagonal=1).bool()


def get_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int],
                                   device: torch.device | str | None = None) -> torch.Tensor:
    """``[sq, skv]`` bool mask, True outside the window ``(left, right)`` around each query's diagonal."""
    device = device or _device.get_current_device()
    allowed = torch.ones(sq, skv, dtype=torch.bool, device=device)
    allowed = torch.triu(allowed, diagonal=skv - sq - window_size[0])
    allowed = torch.tril(allowed, diagonal=skv - sq + window_size[1])
    return ~allowed


def is_layer_window_attention(window_size: tuple[int, int] | None, window_attn_skip_freq: int | list | None,
                              layer_number: int) -> bool:
    """Whether 1-based layer ``layer_number`` uses sliding-window attention.

    No ``window_size``: never. ``window_attn_skip_freq`` None: every layer; an int ``n``: all but every
    ``n``-th layer; a list: its entry for the layer (truthy means windowed).
    """
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    if isinstance(window_attn_skip_freq, list):
        return bool(window_attn_skip_freq[layer_number - 1])
    raise ValueError(f"window_attn_skip_freq must be None, an int or a list, got {window_attn_skip_freq!r}")


@jit_fuser
def gelu_impl(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GeLU (OpenAI's formula)."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GeLU (OpenAI's formula)."""
    return gelu_impl(x)


@jit_fuser
def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GeLU written out, as Megatron's ONNX-friendly version (1.41421 for sqrt(2))."""
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


__all__ = ["attention_mask_func", "erf_gelu", "gelu_impl", "get_default_causal_mask", "get_linear_layer",
           "get_sliding_window_causal_mask", "is_layer_window_attention", "make_sharded_object_for_checkpoint",
           "make_sharded_tensors_for_checkpoint", "openai_gelu", "sharded_state_dict_default"]
