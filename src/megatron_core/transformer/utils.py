"""Megatron-Core's ``transformer.utils`` helpers: sharded-state-dict builders (defined in
``dist_checkpointing.sharded_module``), attention masks (defined in ``_ground.attention_masks``), GeLU variants
and a concatenation that falls back to host memory."""

from __future__ import annotations

import gc
import logging

import torch

from megatron_core import device as _device
from megatron_core._ground.attention_masks import get_default_causal_mask, get_sliding_window_causal_mask
from megatron_core.dist_checkpointing.sharded_module import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_object_for_checkpoint,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron_core.jit import jit_fuser

logger = logging.getLogger(__name__)


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


def cat_with_oom_fallback(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``torch.cat(tensors)``; if that fails (out of device memory), the pieces are concatenated on the CPU instead.

    Used when merging the pieces of a sharded tensor for a checkpoint: the merged tensor may not fit next to its
    pieces on the device. The fallback result lives on the CPU. An error that is not about memory reappears
    from the CPU concatenation.
    """
    try:
        return torch.cat(tensors)
    except RuntimeError as err:  # torch.OutOfMemoryError, or an accelerator's generic allocation failure
        logger.warning("concatenating %d tensors on the device failed (%s); concatenating on the CPU instead",
                       len(tensors), err)
        merged = torch.cat([t.cpu() for t in tensors])
        gc.collect()
        if _device.cuda_available():
            torch.cuda.empty_cache()
        return merged


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


__all__ = ["attention_mask_func", "cat_with_oom_fallback", "ensure_metadata_has_dp_cp_group", "erf_gelu", "gelu_impl",
           "get_default_causal_mask", "get_linear_layer", "get_sliding_window_causal_mask", "is_layer_window_attention",
           "make_sharded_object_for_checkpoint", "make_sharded_tensors_for_checkpoint", "openai_gelu",
           "set_model_to_sequence_parallel", "sharded_state_dict_default"]
