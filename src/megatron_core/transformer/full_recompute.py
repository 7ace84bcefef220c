"""Full activation recompute over a stack of layers (Megatron-Core's ``recompute.checkpointed_forward``).

One function serves every stack that holds its layers in ``self.layers`` (``TransformerBlock``, ``HybridStack``):
with ``recompute_method="uniform"`` the layers run in groups of ``recompute_num_layers``, each group's input
being the only activation kept; with ``"block"`` the first ``recompute_num_layers`` layers are checkpointed one by
one and the rest run normally. Each checkpointed group goes through ``tensor_parallel.checkpoint``, which replays
the forward's RNG states, so dropout draws the same masks when the group is recomputed in the backward.

Layers that are not transformer layers (a hybrid stack's Mamba layers) take no context, context mask, attention
bias or padding mask, and return one tensor rather than ``(hidden_states, context)``. Megatron-Core enters a
quantization context around each layer (``use_inner_quantization_context``) and checkpoints FP8 layers with
Transformer Engine's checkpoint; here that argument has no effect: this library's FP8 GEMMs are chosen when the
layers are built (``fp8_utils.get_fp8_context`` is always a null context), so every precision takes
``tensor_parallel.checkpoint``.
The public path is :mod:`megatron_core.recompute`; the code lives in ``transformer`` because it runs layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core.transformer.transformer_layer import BaseTransformerLayer

__all__ = ["checkpointed_forward"]

# The keyword arguments a layer that is not a transformer layer (a Mamba layer) takes.
_OTHER_LAYER_KEYS = ("attention_mask", "rotary_pos_emb", "inference_context", "packed_seq_params")


def _run_layer(layer: torch.nn.Module, hidden_states: torch.Tensor, context: torch.Tensor | None,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's ``(hidden_states, context)``; a non-transformer layer keeps ``context`` unchanged."""
    if isinstance(layer, BaseTransformerLayer):
        hidden_states, context = layer(hidden_states=hidden_states, context=context, **kwargs)
    else:
        hidden_states = layer(hidden_states=hidden_states,
                              **{k: kwargs[k] for k in _OTHER_LAYER_KEYS})
    if isinstance(hidden_states, tuple):
        hidden_states = hidden_states[0]
    return hidden_states, context


def checkpointed_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: torch.Tensor | None,
    context_mask: torch.Tensor | None,
    rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
    attention_bias: torch.Tensor | None,
    packed_seq_params: Any,
    use_inner_quantization_context: bool,
    padding_mask: torch.Tensor | None = None,
    extract_layer_indices: set[int] | None = None,
    layer_offset: int = 0,
    **layer_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
    """Run ``self.layers`` on ``hidden_states [s, b, h]`` with full activation recompute.

    ``self`` is the stack (it provides ``layers``, ``config`` and ``num_layers_per_pipeline_rank``). Every
    tensor argument (also tensors in ``layer_kwargs``, which this library's layers take in addition:
    ``rotary_pos_cos``, ``rotary_pos_sin``, ``sequence_len_offset``) enters each checkpoint as an input, so
    its gradient flows (a cross-attention ``context``). ``extract_layer_indices`` (global layer indices;
    ``layer_offset`` is this stage's first) asks for intermediate outputs: a group's output is kept when its
    last layer (``uniform``) or its layer (``block``) is listed, and the result is then
    ``(hidden_states, [intermediate, ...])``. ``ValueError`` for a ``recompute_method`` other than
    ``"uniform"`` / ``"block"``.
    """
    config = self.config
    method = config.recompute_method
    if method not in ("uniform", "block"):
        raise ValueError(f"recompute_method ({method!r}) must be 'uniform' or 'block' with "
                         "recompute_granularity='full'")
    extract = set(extract_layer_indices or ())
    intermediates: list[torch.Tensor] = []
    fixed = dict(attention_mask=attention_mask, context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
                 attention_bias=attention_bias, inference_context=None, packed_seq_params=packed_seq_params,
                 padding_mask=padding_mask, **layer_kwargs)
    # Tensors travel as checkpoint inputs (a tuple of RoPE tensors is unpacked); the rest is closed over.
    is_dual_rope = isinstance(rotary_pos_emb, (tuple, list))
    if is_dual_rope and len(rotary_pos_emb) != 2:
        raise ValueError(f"a tuple rotary_pos_emb must hold 2 tensors (local, global), got {len(rotary_pos_emb)}")
    tensor_names = [k for k, v in fixed.items() if isinstance(v, torch.Tensor)]
    tensor_args = [fixed[k] for k in tensor_names]
    if is_dual_rope:
        tensor_args += list(rotary_pos_emb)
    others = {k: v for k, v in fixed.items() if k not in tensor_names}

    def segment(start: int, end: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        def run(hidden: torch.Tensor, ctx: torch.Tensor | None, *tensors: torch.Tensor):
            kwargs = dict(others, **dict(zip(tensor_names, tensors)))
            if is_dual_rope:
                kwargs["rotary_pos_emb"] = tuple(tensors[len(tensor_names):])
            for index in range(start, end):
                hidden, ctx = _run_layer(self.layers[index], hidden, ctx, kwargs)
            return hidden, ctx

        return run

    def run_group(start: int, end: int, checkpointed: bool) -> None:
        nonlocal hidden_states, context
        run = segment(start, end)
        if checkpointed:
            hidden_states, context = tensor_parallel.checkpoint(
                run, bool(config.distribute_saved_activations), hidden_states, context, *tensor_args)
        else:
            hidden_states, context = run(hidden_states, context, *tensor_args)
        kept_at = end - 1 if method == "uniform" else start
        if kept_at + layer_offset in extract:
            intermediates.append(hidden_states)

    num_layers, chunk = self.num_layers_per_pipeline_rank, config.recompute_num_layers
    if method == "uniform":
        for start in range(0, num_layers, chunk):
            run_group(start, min(start + chunk, num_layers), True)
    else:
        for index in range(num_layers):
            run_group(index, index + 1, index < chunk)
    return (hidden_states, intermediates) if extract else hidden_states

