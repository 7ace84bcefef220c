"""A transformer layer cut into the combined 1F1B schedule's slots (Megatron-Core's
``models.gpt.fine_grained_callables.build_transformer_layer_callables``).

A MoE layer becomes four slots, computation and communication alternating so that another
micro-batch's slots can run in between:

1. ``pre_dispatch_computation``: attention, the pre-MLP norm, the shared experts, the router and the
   dispatcher's local permutation; returns ``(permuted tokens, probs)``.
2. ``moe_dispatch``: the dispatch all-to-all; returns the tokens that reach this rank's experts.
3. ``mlp``: the routed experts (between the dispatcher's post- and pre-processing).
4. ``moe_combine``: the combine all-to-all, unpermutation, the shared experts' sum and the MLP's
   bias-dropout-add; returns the layer's output ``[s, b, h]``.

A dense layer has two: ``pre_dispatch_computation`` (attention) and ``mlp`` (the whole MLP half).
The arithmetic is the layer's own forward, step for step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core.transformer.moe.moe_layer import MoELayer
from megatron_core.transformer.transformer_layer import TransformerLayer

__all__ = ["build_transformer_layer_callables"]


def _rng_context(layer: TransformerLayer) -> Any:
    """The model-parallel RNG state a layer's forward runs in (as ``TransformerBlock`` forks it)."""
    if layer.config.sequence_parallel and layer.training:
        return tensor_parallel.get_cuda_rng_tracker().fork()
    return contextlib.nullcontext()


def build_transformer_layer_callables(layer: TransformerLayer) -> tuple[list[Callable | None], dict]:
    """``(forward_funcs, backward_dw)`` for ``layer``'s schedule nodes.

    ``forward_funcs`` holds one ``(node, *inputs) -> outputs`` per slot in the order ``pre_dispatch_computation,
    moe_dispatch, mlp, moe_combine, mtp_post_process`` (None where a slot does not apply). ``backward_dw`` maps a
    slot to the object whose ``backward_dw()`` runs its deferred weight gradients (``delay_wgrad_compute``): the
    attention slot to the layer's ``backward_dw_wrapper`` (attention and shared experts), the ``mlp`` slot to
    ``layer.mlp`` (routed experts, or the dense MLP).
    """
    if not isinstance(layer, TransformerLayer):
        raise ValueError(f"build_transformer_layer_callables needs a TransformerLayer, got {type(layer).__name__}")
    is_moe = isinstance(layer.mlp, MoELayer)

    def attention_forward(node: Any, hidden_states: torch.Tensor) -> Any:
        state = node.chunk_state
        with _rng_context(layer):
            hidden_states, _ = layer._forward_attention(
                hidden_states, attention_mask=state.attention_mask, rotary_pos_emb=state.rotary_pos_emb,
                rotary_pos_cos=state.rotary_pos_cos, rotary_pos_sin=state.rotary_pos_sin,
                packed_seq_params=state.packed_seq_params, sequence_len_offset=state.sequence_len_offset)
            if not is_moe:
                return hidden_states
            moe = layer.mlp
            norm_output, residual, mlp_norm_manager = layer._forward_pre_mlp_layernorm(hidden_states)
            shared_expert_output = moe.shared_experts_compute(norm_output)
            probs, routing_map = moe.route(norm_output)  # the layer's forward routes without a padding mask too
            local_tokens, probs = moe.preprocess(norm_output, probs, routing_map)
        node.layer_state.residual = node.detach(residual)
        node.layer_state.mlp_norm_manager = mlp_norm_manager
        node.layer_state.shared_expert_output = (
            None if shared_expert_output is None else node.detach(shared_expert_output))
        return local_tokens, probs

    def dispatch_forward(node: Any, local_tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        dispatched_tokens, dispatched_probs = layer.mlp.dispatch(local_tokens, probs)
        # The probabilities reach the experts through the layer state, not as an input the node could release.
        node.layer_state.dispatched_probs = node.detach(dispatched_probs)
        return dispatched_tokens

    def experts_forward(node: Any, dispatched_tokens: torch.Tensor) -> torch.Tensor:
        with _rng_context(layer):
            expert_output, _ = layer.mlp.routed_experts_compute(dispatched_tokens, node.layer_state.dispatched_probs)
        node.layer_state.dispatched_probs = None
        return expert_output

    def combine_forward(node: Any, expert_output: torch.Tensor) -> torch.Tensor:
        state = node.layer_state
        output = layer.mlp.postprocess(layer.mlp.combine(expert_output), state.shared_expert_output)
        with _rng_context(layer):
            hidden_states = layer._forward_post_mlp((output, None), state.residual, state.mlp_norm_manager)
        # Made on the computation stream, read here on the communication stream: keep their memory until this
        # stream is done with them.
        for tensor in (state.residual, state.shared_expert_output):
            if tensor is not None and tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream())
        state.residual = state.shared_expert_output = state.mlp_norm_manager = None
        return hidden_states

    def dense_mlp_forward(node: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        with _rng_context(layer):
            return layer._forward_mlp(hidden_states)

    if is_moe:
        forward_funcs = [attention_forward, dispatch_forward, experts_forward, combine_forward, None]
    else:
        forward_funcs = [attention_forward, None, dense_mlp_forward, None, None]
    layer.init_backward_dw_wrapper()
    return forward_funcs, {"pre_dispatch_computation": layer.backward_dw_wrapper, "mlp": layer.mlp}
