"""One micro-batch's forward and backward through a model chunk, node by node (Megatron-Core's
``models.common.model_chunk_schedule_plan``).

``TransformerModelChunkSchedulePlan`` (what ``GPTModel.build_schedule_plan`` returns) holds a
pre-process node, one ``TransformerLayerSchedulePlan`` per layer and, on the last stage, a
post-process node. ``TransformerModelChunkSchedulePlan.run(f, b, b_grad)`` runs plan ``f``'s forward
and plan ``b``'s backward interleaved: forward layer ``i`` with backward layer ``L - 1 - i``, and
within a layer pair the communication slots of one beside the computation slots of the other::

    communication: combine bwd   | dispatch fwd, dispatch bwd | combine fwd
    computation:   attention fwd | experts bwd, experts fwd   | attention bwd

(with ``ep_overlap_early_attn_memory_release`` the attention backward moves before the experts' forward).
On CUDA the communication slots run on their own stream; on a CPU model all run in this order in line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.models.common.fine_grained_callables import build_layer_callables, get_layer_moe_metadata
from megatron_core.models.common.utils import (
    LayerState,
    PostProcessNode,
    PreProcessNode,
    TransformerLayerNode,
)
from megatron_core.pipeline_parallel.schedule_node import (
    AbstractSchedulePlan,
    NoopScheduleNode,
    get_comm_stream,
    get_comp_stream,
)
from megatron_core.transformer.multi_token_prediction import MultiTokenPredictionLayer

__all__ = ["ModelChunkState", "TransformerLayerSchedulePlan", "TransformerModelChunkSchedulePlan"]


class ModelChunkState:
    """The inputs and per-micro-batch values shared by all nodes of a model chunk's plan (attributes: the
    model's forward arguments, the rotary angles, ``model``)."""


def _stream_getters(model: torch.nn.Module) -> tuple[Any, Callable | None, Callable | None]:
    """``(event, computation stream getter, communication stream getter)``; all None for a CPU model."""
    param = next(model.parameters(), None)
    if param is None or not param.is_cuda:
        return None, None, None

    def comm_stream() -> Any:
        return get_comm_stream() or torch.cuda.current_stream()

    return torch.cuda.Event(), get_comp_stream, comm_stream


class TransformerLayerSchedulePlan:
    """The nodes of one transformer layer: ``pre_dispatch_computation``, ``moe_dispatch``, ``mlp``, ``moe_combine``
    (the two MoE communication slots are no-ops in a dense layer) and ``mtp_post_process`` (a no-op except in a
    multi-token-prediction layer, whose inner transformer layer provides the other slots)."""

    def __init__(self, layer: Any, event: Any, chunk_state: ModelChunkState, comp_stream: Any, comm_stream: Any,
                 extra_args: dict | None = None) -> None:
        self.config = layer.config
        self.layer = layer
        self.layer_state = LayerState()
        self.chunk_state = chunk_state
        forward_funcs, backward_dw = build_layer_callables(layer)
        is_moe, num_local_experts = get_layer_moe_metadata(layer)
        is_mtp = isinstance(layer, MultiTokenPredictionLayer)
        mlp = layer.mtp_model_layer.mlp if is_mtp else layer.mlp
        args = dict(extra_args or {}, config=layer.config, is_moe=is_moe, num_local_experts=num_local_experts,
                    token_dispatcher=mlp.token_dispatcher if is_moe else None,
                    delay_wgrad_compute=layer.config.delay_wgrad_compute, is_mtp=is_mtp)

        def node(stream: Any, func: Callable, name: str) -> TransformerLayerNode:
            return TransformerLayerNode(stream, event, self.layer_state, chunk_state, func, name=name,
                                        bwd_dw_callables=backward_dw.get(name), extra_args=args)

        attention, dispatch, mlp_func, combine, mtp_post_process = forward_funcs
        self.pre_dispatch_computation: Any = node(comp_stream, attention, "pre_dispatch_computation")
        self.mlp: Any = node(comp_stream, mlp_func, "mlp")
        if is_moe:
            self.moe_dispatch: Any = node(comm_stream, dispatch, "moe_dispatch")
            self.moe_combine: Any = node(comm_stream, combine, "moe_combine")
        else:
            self.moe_dispatch = NoopScheduleNode()
            self.moe_combine = NoopScheduleNode()
        self.mtp_post_process: Any = (node(comp_stream, mtp_post_process, "mtp_post_process") if is_mtp
                                      else NoopScheduleNode())

    def release_state(self) -> None:
        """Drop the nodes and the layer (after the layer's backward)."""
        self.pre_dispatch_computation = self.moe_dispatch = self.mlp = self.moe_combine = None
        self.mtp_post_process = None
        self.layer_state = None
        self.layer = None

    @staticmethod
    def run(f_layer: TransformerLayerSchedulePlan | None, b_layer: TransformerLayerSchedulePlan | None,
            f_input: Any = None, b_grad: Any = None, is_last_layer_in_bwd: bool = False) -> tuple[Any, Any]:
        """One layer's forward (``f_layer`` from ``f_input``) interleaved with another's backward (``b_layer`` from
        ``b_grad``); returns ``(forward output, gradient of the backward layer's input)``.

        With ``delay_wgrad_compute`` the backward layer's expert (or dense MLP) weight gradients run between its
        experts' backward and its dispatch backward, and its attention slot's right after that slot's backward,
        except for the chunk's last backward layer (``is_last_layer_in_bwd``), whose attention weight gradients
        the chunk's ``run`` defers past the pipeline send.
        """
        early_attn_release = b_layer is not None and b_layer.config.ep_overlap_early_attn_memory_release
        if b_layer is not None:
            b_grad = b_layer.mtp_post_process.backward(b_grad)
            b_grad = b_layer.moe_combine.backward(b_grad)
        if f_layer is not None:
            f_input = f_layer.pre_dispatch_computation.forward(f_input)
        if b_layer is not None:
            b_grad = b_layer.mlp.backward(b_grad)
        if f_layer is not None:
            f_input = f_layer.moe_dispatch.forward(f_input)
        if b_layer is not None:
            b_layer.mlp.backward_dw()
            b_grad = b_layer.moe_dispatch.backward(b_grad)
            if early_attn_release:
                b_grad = b_layer.pre_dispatch_computation.backward(b_grad)
        if f_layer is not None:
            f_input = f_layer.mlp.forward(f_input)
            f_input = f_layer.moe_combine.forward(f_input)
        if b_layer is not None and not early_attn_release:
            b_grad = b_layer.pre_dispatch_computation.backward(b_grad)
        if f_layer is not None:
            f_input = f_layer.mtp_post_process.forward(f_input)
        if b_layer is not None and not is_last_layer_in_bwd:
            b_layer.pre_dispatch_computation.backward_dw()
        return f_input, b_grad


class TransformerModelChunkSchedulePlan(AbstractSchedulePlan):
    """A model chunk's nodes for one micro-batch: ``pre_process``, the layers' plans, ``post_process`` (last stage).

    Built from the arguments of the model's ``forward``; nothing runs until :meth:`run`.
    """

    def __init__(self, model: Any, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                 attention_mask: torch.Tensor | None, decoder_input: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, packed_seq_params: Any = None, extra_block_kwargs: Any = None,
                 runtime_gather_output: bool | None = None, loss_mask: torch.Tensor | None = None,
                 padding_mask: torch.Tensor | None = None) -> None:
        # Imported here: the causal-mask helper lives with the attention modules.
        from megatron_core.transformer.causal_mask import drop_plain_causal_mask

        state = self._model_chunk_state = ModelChunkState()
        state.model = model
        state.input_ids, state.position_ids, state.labels = input_ids, position_ids, labels
        state.attention_mask = drop_plain_causal_mask(model.decoder, attention_mask)
        state.decoder_input, state.loss_mask, state.padding_mask = decoder_input, loss_mask, padding_mask
        state.packed_seq_params, state.extra_block_kwargs = packed_seq_params, extra_block_kwargs
        state.runtime_gather_output = runtime_gather_output
        state.rotary_pos_emb = state.rotary_pos_cos = state.rotary_pos_sin = state.sequence_len_offset = None
        self.vp_stage = model.vp_stage
        self._event, comp_stream, comm_stream = _stream_getters(model)
        self.pre_process: Any = PreProcessNode(model, state, self._event, comp_stream)
        state.mtp_hidden_states = None
        self._transformer_layers: list[TransformerLayerSchedulePlan] = []
        mtp = getattr(model, "mtp", None) if getattr(model, "mtp_process", False) else None
        for module in (model.decoder, mtp):  # the MTP depths after the decoder's layers, as in the forward
            layers = list(module.layers) if module is not None else []
            self._transformer_layers += [
                TransformerLayerSchedulePlan(layer, self._event, state, comp_stream, comm_stream,
                                             {"is_first_layer": i == 0, "is_last_layer": i == len(layers) - 1})
                for i, layer in enumerate(layers)
            ]
        self.post_process: Any = (PostProcessNode(model, state, self._event, comp_stream)
                                  if model.post_process else None)

    @property
    def event(self) -> Any:
        """The event ordering this plan's nodes across streams (None on a CPU model)."""
        return self._event

    @property
    def state(self) -> ModelChunkState:
        """The chunk state shared by the nodes."""
        return self._model_chunk_state

    def record_current_stream(self) -> None:
        """Record the plan's event on the current stream (CUDA only)."""
        if self._event is not None:
            self._event.record(torch.cuda.current_stream())

    def wait_current_stream(self) -> None:
        """Make the current stream wait for the plan's event (CUDA only)."""
        if self._event is not None:
            self._event.wait(torch.cuda.current_stream())

    def get_layer(self, i: int) -> TransformerLayerSchedulePlan:
        """Layer ``i``'s plan."""
        return self._transformer_layers[i]

    def pop_layer(self) -> TransformerLayerSchedulePlan:
        """Remove and return the last layer's plan (the backward walks the layers last to first)."""
        return self._transformer_layers.pop()

    def num_layers(self) -> int:
        """How many layer plans are left."""
        return len(self._transformer_layers)

    def release_state(self) -> None:
        """Drop the references to the model and the nodes (after the backward)."""
        self._model_chunk_state.model = None
        self.pre_process = None
        self.post_process = None

    @staticmethod
    def run(f_schedule_plan: TransformerModelChunkSchedulePlan | None,
            b_schedule_plan: TransformerModelChunkSchedulePlan | None, b_grad: Any = None,
            pre_forward: Callable | None = None, pre_backward: Callable | None = None,
            post_forward: Callable | None = None, post_backward: Callable | None = None) -> Any:
        """``f_schedule_plan``'s forward interleaved with ``b_schedule_plan``'s backward from ``b_grad``.

        Forward layer ``i`` pairs with backward layer ``L_b - 1 - i``; the layers left over on either side run
        alone; then the forward's post-process and the backward's pre-process. The ``pre_*`` / ``post_*``
        callbacks (pipeline exchanges) get the plan's ``vp_stage`` and, for ``post_*``, the tensor to send.
        Returns the forward's output (the loss on the last stage, else the chunk's output activation).
        """
        f_input = None
        if f_schedule_plan is not None:
            if pre_forward is not None:
                pre_forward(f_schedule_plan.vp_stage)
            f_schedule_plan.record_current_stream()
            f_input = f_schedule_plan.pre_process.forward()
        if b_schedule_plan is not None:
            if b_grad is None:
                raise ValueError("a backward schedule plan needs the gradient of its output (b_grad)")
            b_schedule_plan.record_current_stream()
            if pre_backward is not None:
                pre_backward(b_schedule_plan.vp_stage)
                b_schedule_plan.record_current_stream()
            if b_schedule_plan.post_process is not None:
                b_grad = b_schedule_plan.post_process.backward(b_grad)

        f_layers = f_schedule_plan.num_layers() if f_schedule_plan is not None else 0
        b_layers = b_schedule_plan.num_layers() if b_schedule_plan is not None else 0
        last_b_layer = None
        for i in range(max(f_layers, b_layers)):
            f_layer = f_schedule_plan.get_layer(i) if i < f_layers else None
            b_layer = b_schedule_plan.pop_layer() if i < b_layers else None
            f_input, b_grad = TransformerLayerSchedulePlan.run(
                f_layer, b_layer, f_input=f_input, b_grad=b_grad, is_last_layer_in_bwd=i == b_layers - 1)
            if b_layer is not None and i < b_layers - 1:
                b_layer.release_state()
            elif b_layer is not None:
                last_b_layer = b_layer

        if f_schedule_plan is not None and post_forward is not None:
            f_schedule_plan.wait_current_stream()
            post_forward(f_input, f_schedule_plan.vp_stage)
        if b_schedule_plan is not None and post_backward is not None:
            b_schedule_plan.wait_current_stream()
            post_backward(b_grad, b_schedule_plan.vp_stage)
        if last_b_layer is not None:
            # The chunk's first layer's attention weight gradients, deferred past the send of its input gradient.
            last_b_layer.pre_dispatch_computation.backward_dw()
            last_b_layer.release_state()
        if f_schedule_plan is not None and f_schedule_plan.post_process is not None:
            f_input = f_schedule_plan.post_process.forward(f_input)
        if b_schedule_plan is not None:
            b_schedule_plan.pre_process.backward(b_grad)
        if f_schedule_plan is not None:
            f_schedule_plan.wait_current_stream()
        if b_schedule_plan is not None:
            b_schedule_plan.wait_current_stream()
            b_schedule_plan.release_state()
        return f_input
