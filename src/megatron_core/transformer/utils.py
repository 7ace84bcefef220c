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
    raise ValueError(f"Invalid `window_attn_skip_freq`: {type(window_attn_skip_freq).__name__} "
                     f"{window_attn_skip_freq!r}; it must be None, an int or a list")


_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


def set_model_to_sequence_parallel(model: torch.nn.Module, set_to: bool = False,
                                   exclude_modules: list[torch.nn.Module] | None = None) -> None:
    """Switch sequence parallelism of a built model on or off (Megatron-Core's; e.g. for inference).

    Sets ``model.config.sequence_parallel`` and, on every submodule that has them (except ``exclude_modules`` and
    their children), the attributes ``sequence_parallel``, ``scatter_to_sequence_parallel`` and
    ``reduce_scatter_embeddings`` (not the last with learned absolute position embeddings, which are added
    after the embedding's output is scattered).
    """
    attrs = [a for a in _SEQUENCE_PARALLEL_ATTRS
             if not (a == "reduce_scatter_embeddings"
                     and getattr(model, "position_embedding_type", None) == "learned_absolute")]
    excluded = {id(m) for m in exclude_modules or ()}
    model.config.sequence_parallel = set_to
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in excluded:
            continue
        for attr in attrs:
            if hasattr(module, attr):
                setattr(module, attr, set_to)
        stack.extend(child for child in module._modules.values() if child is not None)


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
           "make_sharded_tensors_for_checkpoint", "openai_gelu", "set_model_to_sequence_parallel",
           "sharded_state_dict_default"]
