"""The model-side schedule nodes of the combined 1F1B schedule (Megatron-Core's ``models.common.utils``).

``PreProcessNode`` runs a model chunk's embedding and rotary angles, ``PostProcessNode`` its final norm,
output layer and loss, and ``TransformerLayerNode`` one slot of a transformer layer (attention up to
the MoE dispatch, the dispatch all-to-all, the experts, the combine all-to-all). Values one slot hands
to a later slot of the same layer outside its outputs (the residual, the dispatched probabilities,
the shared experts' output) are detached through :meth:`TransformerLayerNode.detach` and kept in the
layer's ``LayerState``; the slot that made them backpropagates their gradients with its own.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from megatron_core.pipeline_parallel.schedule_node import ScheduleNode, make_viewless

__all__ = ["LayerState", "PostProcessNode", "PreProcessNode", "TransformerLayerNode", "should_free_input",
           "weak_method"]


def weak_method(method: Callable) -> Callable:
    """``method`` called through a weak reference to its object, so that a node holding it does not keep its
    own plan (and through it the model chunk) alive."""
    method_ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        return method_ref()(*args, **kwargs)

    return call


def should_free_input(name: str, is_moe: bool, config: Any, num_local_experts: int | None,
                      token_dispatcher: Any = None) -> bool:
    """Whether the layer slot ``name`` may release its inputs' memory once its forward has run.

    Only where no autograd node keeps the input (or a view of it), which depends on what the all-to-all
    dispatcher does: the all-to-all over more than one expert-parallel rank makes new tensors, so the
    dispatch's inputs (the permuted tokens and probabilities) and the combine's input (the experts' output)
    are free after their forward; the experts' input is free when the dispatcher first makes a new tensor of
    it (an all-gather over expert tensor parallelism, or a regroup by local expert). Dense layers, the
    attention slot, and other dispatchers keep their inputs.
    """
    from megatron_core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not is_moe or not isinstance(token_dispatcher, MoEAlltoAllTokenDispatcher) or token_dispatcher.ep_size < 2:
        return False
    regrouped = (num_local_experts or 0) > 1 or token_dispatcher.tp_size > 1
    return {"mlp": regrouped, "moe_combine": True, "moe_dispatch": True}.get(name, False)


class LayerState:
    """Values shared between the slots of one transformer layer for one micro-batch (attributes set by the
    slots: ``residual``, ``dispatched_probs``, ``shared_expert_output``, ``mlp_norm_manager``)."""


class PreProcessNode(ScheduleNode):
    """A model chunk's start: the embedding (first stage) or the received activation, and the rotary angles.

    Stores the angles and the padding mask in the chunk state for the layer nodes; returns ``[s, b, h]``.
    """

    def __init__(self, model: Any, chunk_state: Any, event: Any, stream: Any) -> None:
        super().__init__(weak_method(self.forward_impl), stream, event, name="pre_process")
        self.model = model
        self.chunk_state = chunk_state

    def forward_impl(self) -> torch.Tensor:
        """Run the model's ``_preprocess`` on the chunk's inputs."""
        state = self.chunk_state
        if not self.model.pre_process:
            state.decoder_input = self.model.decoder.input_tensor
        decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = (
            self.model._preprocess(input_ids=state.input_ids, position_ids=state.position_ids,
                                   decoder_input=state.decoder_input, packed_seq_params=state.packed_seq_params,
                                   padding_mask=state.padding_mask))
        state.decoder_input = decoder_input
        state.rotary_pos_emb = rotary_pos_emb
        state.rotary_pos_cos = rotary_pos_cos
        state.rotary_pos_sin = rotary_pos_sin
        state.sequence_len_offset = sequence_len_offset
        state.padding_mask = padding_mask
        return decoder_input


class PostProcessNode(ScheduleNode):
    """A model chunk's end on the last stage: the decoder's final norm, the output layer and the loss (fp32)."""

    def __init__(self, model: Any, chunk_state: Any, event: Any, stream: Any) -> None:
        super().__init__(weak_method(self.forward_impl), stream, event, name="post_process")
        self.model = model
        self.chunk_state = chunk_state

    def forward_impl(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final norm (when this chunk holds it and no MTP layers, whose first node applies it before the
        depths), then the model's ``_postprocess``."""
        final_layernorm = getattr(self.model.decoder, "final_layernorm", None)
        if final_layernorm is not None and not getattr(self.model, "mtp_process", False):
            hidden_states = make_viewless(final_layernorm(hidden_states))
        state = self.chunk_state
        loss = self.model._postprocess(
            hidden_states=hidden_states, input_ids=state.input_ids, position_ids=state.position_ids,
            labels=state.labels, rotary_pos_emb=state.rotary_pos_emb, rotary_pos_cos=state.rotary_pos_cos,
            rotary_pos_sin=state.rotary_pos_sin, mtp_in_postprocess=False, loss_mask=state.loss_mask,
            decoder_input=state.decoder_input, attention_mask=state.attention_mask,
            packed_seq_params=state.packed_seq_params, sequence_len_offset=state.sequence_len_offset,
            runtime_gather_output=state.runtime_gather_output)
        return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss


class TransformerLayerNode(ScheduleNode):
    """One slot of a transformer layer (``pre_dispatch_computation``, ``moe_dispatch``, ``mlp``, ``moe_combine``).

    Args:
        stream, event: as :class:`~megatron_core.pipeline_parallel.schedule_node.ScheduleNode`.
        layer_state: the layer's :class:`LayerState` for this micro-batch.
        chunk_state: the model chunk's state (inputs, rotary angles, masks).
        submodule: ``(node, *inputs) -> outputs``, the slot's forward.
        name: the slot's name (it decides whether the inputs are released after the forward).
        bwd_dw_callables: an object (or a list of them) whose ``backward_dw()`` runs this slot's deferred weight
            gradients; :meth:`backward_dw` calls them when ``extra_args['delay_wgrad_compute']`` is set.
        extra_args: ``config``, ``is_moe``, ``num_local_experts``, ``token_dispatcher``, ``is_first_layer``,
            ``is_last_layer``, ``delay_wgrad_compute``.
    """

    def __init__(self, stream: Any, event: Any, layer_state: LayerState, chunk_state: Any, submodule: Callable,
                 name: str = "default", bwd_dw_callables: Any = None, extra_args: dict | None = None) -> None:
        extra_args = extra_args or {}
        config = extra_args.get("config")
        if config is None:
            raise ValueError("TransformerLayerNode needs extra_args['config'] (the layer's config)")
        free_input = should_free_input(name, extra_args.get("is_moe", False), config,
                                       extra_args.get("num_local_experts"), extra_args.get("token_dispatcher"))
        super().__init__(weak_method(self.forward_impl), stream, event, weak_method(self.backward_impl),
                         free_input=free_input, name=name)
        self.layer_state = layer_state
        self.chunk_state = chunk_state
        self.submodule = submodule
        self.detached: tuple = ()
        self.before_detached: tuple = ()
        self.is_first_layer = extra_args.get("is_first_layer", False)
        self.is_last_layer = extra_args.get("is_last_layer", False)
        self.delay_wgrad_compute = bool(extra_args.get("delay_wgrad_compute", False))
        if bwd_dw_callables is None:
            bwd_dw_callables = []
        self.bwd_dw_callables = bwd_dw_callables if isinstance(bwd_dw_callables, list) else [bwd_dw_callables]

    def detach(self, tensor: torch.Tensor) -> torch.Tensor:
        """A detached leaf of ``tensor`` for a later slot; this slot's backward sends its gradient on."""
        detached = make_viewless(tensor).detach()
        detached.requires_grad = tensor.requires_grad
        self.before_detached = self.before_detached + (tensor,)
        self.detached = self.detached + (detached,)
        return detached

    def forward_impl(self, *args: Any) -> Any:
        """Run the slot's forward."""
        return self.submodule(self, *args)

    def backward_impl(self, outputs: tuple, output_grad: tuple) -> tuple:
        """Backpropagate the outputs' gradients and those the later slots left on the detached values."""
        grads = tuple(output_grad) + tuple(e.grad for e in self.detached)
        self.default_backward_func(tuple(outputs) + self.before_detached, grads)
        return grads

    def backward_dw(self) -> None:
        """Run the slot's deferred weight-gradient GEMMs on its stream (nothing without ``delay_wgrad_compute``);
        once per micro-batch: the callables are dropped afterwards."""
        if not self.delay_wgrad_compute or not self.bwd_dw_callables:
            return
        stream = self._resolve_stream()
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            for callable_ in self.bwd_dw_callables:
                callable_.backward_dw()
        self.bwd_dw_callables = []

    def _release_state(self) -> None:
        super()._release_state()
        self.detached = ()
        self.before_detached = ()
        self.layer_state = None
        self.chunk_state = None
        self.submodule = None
