"""Which slot functions a layer's schedule nodes run (Megatron-Core's ``models.common.fine_grained_callables``).

``build_layer_callables`` picks the builder for the layer's type; ``get_layer_moe_metadata`` tells the
plan whether the layer has MoE dispatch and combine slots. Transformer layers (dense or MoE) and
multi-token-prediction layers (``build_mtp_layer_callables``) are supported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._misc_utils import make_viewless_tensor
from megatron_core.models.gpt.fine_grained_callables import build_transformer_layer_callables
from megatron_core.transformer.moe.moe_layer import MoELayer
from megatron_core.transformer.mtp_placement import get_mtp_layer_offset
from megatron_core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron_core.transformer.transformer_layer import TransformerLayer

__all__ = ["build_layer_callables", "build_mtp_layer_callables", "get_layer_moe_metadata"]


def get_layer_moe_metadata(layer: Any) -> tuple[bool, int | None]:
    """``(is_moe, num_local_experts)`` of a transformer layer, or of an MTP layer's inner transformer layer
    (``None`` experts for a dense layer)."""
    if isinstance(layer, MultiTokenPredictionLayer):
        return get_layer_moe_metadata(layer.mtp_model_layer)
    if not isinstance(layer, TransformerLayer):
        raise ValueError(f"the combined 1F1B schedule plan supports TransformerLayer and MultiTokenPredictionLayer, "
                         f"got {type(layer).__name__}")
    if isinstance(layer.mlp, MoELayer):
        return True, layer.mlp.num_local_experts
    return False, None


def _fork_rng(layer: Any) -> Any:
    """The model-parallel RNG fork an MTP depth runs its projection in under sequence parallelism."""
    return tensor_parallel.get_cuda_rng_tracker().fork() if layer.sequence_parallel else contextlib.nullcontext()


def build_mtp_layer_callables(layer: MultiTokenPredictionLayer) -> tuple[list[Callable | None], dict]:
    """``(forward_funcs, backward_dw)`` for an MTP depth's nodes: its inner transformer layer's slots, with the
    depth's own steps around them.

    - ``pre_dispatch_computation`` (first MTP layer of the chunk): the decoder's final norm (when this chunk holds
      it), then the decoder output is cut into the main model's part and earlier depths' (as
      ``MultiTokenPredictionBlock`` does) and kept for the end; every depth then rolls the token ids and
      positions once more (kept in the chunk state as ``mtp_input_ids`` / ``mtp_position_ids`` /
      ``mtp_padding_mask``), embeds them, projects ``[embedding; hidden]`` (``eh_proj``) and runs the inner
      layer's attention slot.
    - ``mtp_post_process``: the depth's final norm; the chunk's last MTP layer returns the decoder's and every
      depth's hidden states concatenated along the sequence, what ``GPTModel._postprocess`` splits for the loss.
    """
    inner = layer.mtp_model_layer
    if not isinstance(inner, TransformerLayer):
        raise ValueError(f"the combined 1F1B schedule plan supports MTP depths built on a TransformerLayer, got "
                         f"{type(inner).__name__} (hybrid mtp_layer_pattern depths are not scheduled)")
    forward_funcs, backward_dw = build_transformer_layer_callables(inner)
    attention_forward, dispatch_forward, mlp_forward, combine_forward, _ = forward_funcs

    def mtp_pre_dispatch_forward(node: Any, hidden_states: torch.Tensor) -> Any:
        state = node.chunk_state
        model = state.model
        if node.is_first_layer:
            final_layernorm = getattr(model.decoder, "final_layernorm", None)
            if final_layernorm is not None:
                hidden_states = make_viewless_tensor(inp=final_layernorm(hidden_states), requires_grad=True,
                                                     keep_graph=True)
            offset = get_mtp_layer_offset(layer.config, model.vp_stage)
            parts = list(torch.chunk(hidden_states, 1 + offset, dim=0))
            state.mtp_hidden_states = [node.detach(part) for part in parts]
            hidden_states = parts[offset]
            state.mtp_input_ids, state.mtp_position_ids = state.input_ids, state.position_ids
            state.mtp_padding_mask = state.padding_mask
        if layer.config.mtp_detach_heads:
            hidden_states = hidden_states.detach()
        input_ids, position_ids, padding_mask, decoder_input = layer._inputs(
            state.mtp_input_ids, state.mtp_position_ids, state.mtp_padding_mask, model.embedding,
            state.packed_seq_params)
        state.mtp_input_ids, state.mtp_position_ids, state.mtp_padding_mask = input_ids, position_ids, padding_mask
        with _fork_rng(layer):
            projected = layer._project(hidden_states, decoder_input)
        return attention_forward(node, projected)

    def mtp_post_process_forward(node: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        state = node.chunk_state
        hidden_states = make_viewless_tensor(inp=layer.final_layernorm(hidden_states), requires_grad=True,
                                             keep_graph=True)
        state.mtp_hidden_states.append(hidden_states)
        if not node.is_last_layer:
            return hidden_states
        output = torch.cat(state.mtp_hidden_states, dim=0)
        state.mtp_hidden_states = None
        return output

    pre_dispatch_dw = backward_dw["pre_dispatch_computation"]
    backward_dw = dict(backward_dw)
    backward_dw["pre_dispatch_computation"] = [pre_dispatch_dw, layer.eh_proj] if hasattr(
        layer.eh_proj, "backward_dw") else pre_dispatch_dw
    return [mtp_pre_dispatch_forward, dispatch_forward, mlp_forward, combine_forward,
            mtp_post_process_forward], backward_dw


def build_layer_callables(layer: Any) -> tuple[list[Callable | None], dict]:
    """``(forward_funcs, backward_dw)`` for ``layer``'s nodes (see ``build_transformer_layer_callables`` and
    :func:`build_mtp_layer_callables`)."""
    if isinstance(layer, MultiTokenPredictionLayer):
        return build_mtp_layer_callables(layer)
    if not isinstance(layer, TransformerLayer):
        raise ValueError(f"the combined 1F1B schedule plan supports TransformerLayer and MultiTokenPredictionLayer, "
                         f"got {type(layer).__name__}")
    return build_transformer_layer_callables(layer)
