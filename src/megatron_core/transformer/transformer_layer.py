"""One pre-norm transformer layer (Megatron-Core's ``TransformerLayer`` + ``TransformerLayerSubmodules``).

``x = x + dropout(attn(norm1(x)))``, then ``x = x + dropout(mlp(norm2(x)))`` on ``[s, b, h]``.
Every slot is built from a spec; slots left at their defaults are identities, so the same
forward serves layers without, say, a separate input norm (Transformer Engine fuses it into QKV).
``layer_number`` is **global** and 1-based: the constructor adds this pipeline chunk's offset.
The forward has no data-dependent Python branches, so ``torch.compile`` can wrap a whole layer.

``BaseTransformerLayer`` is Megatron-Core's marker base of transformer-like layers (a block fans a single layer
spec out to all its layers when the spec's module derives from it). ``MoETransformerLayer`` is the layer of MoE
slots: it computes what ``TransformerLayer`` computes and also exposes the MoE MLP as three steps (router,
expert compute, postprocess), which Megatron-Core captures as partial CUDA graphs; this library's CUDA graphs
refuse MoE layers (``transformer_validation.check_cuda_graphs``), so the steps always run eagerly.
``MlpInterface`` / ``MlpBuilder`` are the MLP slot's typing protocols (:mod:`.submodule_protocols`).
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_core._activation_offload.interface import (
    FineGrainedActivationOffloadingInterface as off_interface,
)
from megatron_core._ground import get_pg_rank, get_pg_size, register_fsdp_unit
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.tensor_parallel.delayed_wgrad import enable_delayed_wgrad
from megatron_core.transformer import fused_decode
from megatron_core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron_core.transformer.layer_backward_dw import LayerBackwardDW
from megatron_core.transformer.layer_cuda_graphs import call_through_cuda_graph, wants_cuda_graph
from megatron_core.transformer.module import GraphableMegatronModule
from megatron_core.transformer.pipeline_layout import get_transformer_layer_offset
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.submodule_protocols import MlpBuilder, MlpInterface
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["BaseTransformerLayer", "MlpBuilder", "MlpInterface", "MoETransformerLayer", "TransformerLayer",
           "TransformerLayerSubmodules", "get_transformer_layer_offset"]


@dataclass
class TransformerLayerSubmodules:
    """Specs for each slot of a layer; unset slots are identities."""

    input_layernorm: ModuleSpec | type = IdentityOp
    self_attention: ModuleSpec | type = IdentityOp
    self_attn_bda: ModuleSpec | type | Any = IdentityFuncOp
    pre_cross_attn_layernorm: ModuleSpec | type = IdentityOp
    cross_attention: ModuleSpec | type = IdentityOp
    cross_attn_bda: ModuleSpec | type | Any = IdentityFuncOp
    pre_mlp_layernorm: ModuleSpec | type = IdentityOp
    mlp: ModuleSpec | type = IdentityOp
    mlp_bda: ModuleSpec | type | Any = IdentityFuncOp
    sharded_state_dict_keys_map: dict[str, str] = field(default_factory=dict)


class BaseTransformerLayer(ABC):  # noqa: B024 (a marker base without abstract methods, as in Megatron-Core)
    """Marker base of transformer-like layers.

    ``TransformerBlock`` treats a spec whose module derives from it as the spec of every layer of the block;
    custom layer classes that want the same derive from it too. It has no methods (an ABC without abstract
    methods, as in Megatron-Core).
    """


@register_fsdp_unit
class TransformerLayer(GraphableMegatronModule, BaseTransformerLayer):
    """A transformer layer: norm, self-attention, bias-dropout-add, norm, MLP, bias-dropout-add."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        pg_collection: Any = None,
        vp_stage: int | None = None,
        is_mtp_layer: bool = False,
        add_layer_offset: bool = True,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config, vp_stage)
        self.submodules_config = submodules
        # Every submodule gets the same groups: pg_collection, else parallel_state's.
        self.pg_collection = pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = pg_collection.tp
        if is_mtp_layer:  # an MTP depth numbers its layer itself (its MoE router logs after the decoder's)
            offset = 0
        elif add_layer_offset and pp_layer_offset is None:
            pp_group = getattr(pg_collection, "pp", None)
            offset = get_transformer_layer_offset(
                config, vp_stage, get_pg_rank(pp_group), pp_size=get_pg_size(pp_group)
            )
        elif add_layer_offset:
            offset = pp_layer_offset
        else:
            offset = 0
        self.layer_number = layer_number + offset
        self.vp_stage = vp_stage
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

        self.input_layernorm = build_module(submodules.input_layernorm, **norm_kwargs)
        self.self_attention = build_module(
            submodules.self_attention, config=config, layer_number=self.layer_number, pg_collection=pg_collection
        )
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, **norm_kwargs)
        self.cross_attention = build_module(
            submodules.cross_attention, config=config, layer_number=self.layer_number, pg_collection=pg_collection
        )
        self.cross_attn_bda = build_module(submodules.cross_attn_bda, config=config)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_kwargs)
        self.is_mtp_layer = is_mtp_layer
        mlp_kwargs = {"is_mtp_layer": True} if is_mtp_layer and _builds_moe_layer(submodules.mlp) else {}
        self.mlp = build_module(submodules.mlp, config=config, pg_collection=pg_collection, **mlp_kwargs)
        if hasattr(self.mlp, "set_layer_number"):  # MoE: the router logs its losses per global layer
            self.mlp.set_layer_number(self.layer_number)
        self.mlp_bda = build_module(submodules.mlp_bda)
        self.has_cross_attention = not isinstance(self.cross_attention, IdentityOp)
        # Fine-grained activation offloading of the norms' inputs (a fused norm, IdentityOp here, has none).
        offload = set(config.offload_modules or []) if config.fine_grained_activation_offloading else set()
        self.offload_attn_norm = "attn_norm" in offload and not isinstance(self.input_layernorm, IdentityOp)
        self.offload_mlp_norm = "mlp_norm" in offload and not isinstance(self.pre_mlp_layernorm, IdentityOp)
        # delay_wgrad_compute: the attention's and the MLP's linears queue their weight gradients for the combined
        # 1F1B schedule's backward_dw calls. Not in an MTP layer, which that schedule does not run node by node.
        self.backward_dw_wrapper: Any = None
        if config.delay_wgrad_compute and not is_mtp_layer:
            enable_delayed_wgrad(self.self_attention)
            enable_delayed_wgrad(self.mlp)

    def init_backward_dw_wrapper(self) -> None:
        """Set ``self.backward_dw_wrapper``: the ``backward_dw`` of the combined 1F1B schedule's attention slot
        (see :class:`~megatron_core.transformer.layer_backward_dw.LayerBackwardDW`)."""
        self.backward_dw_wrapper = LayerBackwardDW(self)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The sharded state, with checkpoint keys renamed by the spec's ``sharded_state_dict_keys_map``.

        The local spec stores its separate norms under Transformer Engine's fused names
        (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``), as Megatron-Core does, so
        checkpoints of either spec load into the other; the dict keys (``state_dict`` names) are unchanged.
        """
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        keys_map = self.submodules_config.sharded_state_dict_keys_map
        if keys_map:
            from megatron_core.dist_checkpointing.utils import apply_prefix_mapping

            apply_prefix_mapping(sharded, {f"{prefix}{old}": f"{prefix}{new}" for old, new in keys_map.items()})
        return sharded

    def _norm_and_residual(self, norm: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """``(norm(hidden_states), residual)``; the residual is ``hidden_states`` (in fp32 with
        ``fp32_residual_connection``).

        A norm that can hand back its input (``returns_residual``: this library's RMSNorm) returns both from one
        autograd node, so that its backward adds the residual's gradient in the same kernel.
        """
        if self.config.fp32_residual_connection:
            return norm(hidden_states), hidden_states.float()
        if getattr(norm, "returns_residual", False):
            return norm(hidden_states, return_residual=True)
        return norm(hidden_states), hidden_states

    def _should_call_local_cudagraph(self, *args: Any, **kwargs: Any) -> bool:
        """Whether ``cuda_graph_impl="local"`` applies to this call
        (:func:`~megatron_core.transformer.layer_cuda_graphs.wants_cuda_graph`)."""
        return wants_cuda_graph(self.config, args[0] if args else kwargs.get("hidden_states"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the layer: through its recorded CUDA graphs where :meth:`_should_call_local_cudagraph` says so, else
        as any module."""
        if self._should_call_local_cudagraph(*args, **kwargs):
            return call_through_cuda_graph(self, args, kwargs)
        return super().__call__(*args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the layer on ``hidden_states`` ``[s, b, h]``; returns ``(hidden_states, context)``."""
        if inference_context is not None and fused_decode.fused_decode_applies(self, hidden_states):
            return fused_decode.fused_decode_forward(self, hidden_states, inference_context, rotary_pos_emb), context
        hidden_states, context = self._forward_attention(
            hidden_states, attention_mask=attention_mask, context=context, context_mask=context_mask,
            rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias, inference_context=inference_context, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        return self._forward_mlp(hidden_states), context

    def _forward_attention(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention half: norm, self-attention, bias-dropout-add (and cross-attention); ``(hidden, context)``."""
        attn_norm_manager = off_interface(self.offload_attn_norm, hidden_states, "attn_norm")
        with attn_norm_manager as hidden_states:
            input_layernorm_output, residual = self._norm_and_residual(self.input_layernorm, hidden_states)
        attention_output_with_bias = self.self_attention(
            input_layernorm_output,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        released = [residual]  # the norm's input: offloaded with attn_norm, no longer needed after the add
        if self.config.apply_residual_connection_post_layernorm:
            residual, released = input_layernorm_output, []
        hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
            attention_output_with_bias, residual, self.hidden_dropout
        )
        hidden_states = attn_norm_manager.group_offload(hidden_states, forced_released_tensors=released)

        if self.has_cross_attention:
            residual = hidden_states
            pre_cross_attn_output = self.pre_cross_attn_layernorm(hidden_states)
            cross_output_with_bias = self.cross_attention(
                pre_cross_attn_output, attention_mask=context_mask, key_value_states=context
            )
            hidden_states = self.cross_attn_bda(self.training, self.config.bias_dropout_fusion)(
                cross_output_with_bias, residual, self.hidden_dropout
            )
        return hidden_states, context

    def _forward_mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MLP half: norm, MLP (or MoE), bias-dropout-add."""
        pre_mlp_layernorm_output, residual, mlp_norm_manager = self._forward_pre_mlp_layernorm(hidden_states)
        return self._forward_post_mlp(self.mlp(pre_mlp_layernorm_output), residual, mlp_norm_manager)

    def _forward_pre_mlp_layernorm(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(norm output, residual of the MLP's bias-dropout-add, the mlp_norm offload manager)``."""
        mlp_norm_manager = off_interface(self.offload_mlp_norm, hidden_states, "mlp_norm")
        with mlp_norm_manager as hidden_states:
            pre_mlp_layernorm_output, residual = self._norm_and_residual(self.pre_mlp_layernorm, hidden_states)
        if self.config.apply_residual_connection_post_layernorm:
            residual = pre_mlp_layernorm_output
        return pre_mlp_layernorm_output, residual, mlp_norm_manager

    def _forward_post_mlp(self, mlp_output_with_bias: Any, residual: torch.Tensor,
                          mlp_norm_manager: Any) -> torch.Tensor:
        """The MLP's bias-dropout-add onto ``residual``, then the end of the mlp_norm offload group."""
        released = [] if self.config.apply_residual_connection_post_layernorm else [residual]
        hidden_states = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
            mlp_output_with_bias, residual, self.hidden_dropout
        )
        return mlp_norm_manager.group_offload(hidden_states, forced_released_tensors=released)


class MoETransformerLayer(TransformerLayer):
    """A transformer layer whose MLP slot is an ``MoELayer``, with the MoE MLP split into three steps.

    ``forward`` computes exactly what :class:`TransformerLayer` computes. The steps
    :meth:`_forward_mlp_router` (pre-MLP norm, shared experts, routing, dispatch preprocessing),
    :meth:`_forward_mlp_expert_compute` (dispatch, experts, combine) and :meth:`_forward_mlp_postprocess`
    (unpermute, shared-expert sum, bias-dropout-add) chained give the same result as ``_forward_mlp``. Megatron-Core
    records the first and last as CUDA graphs (``use_partial_cudagraphs``); here they run eagerly, so
    ``use_partial_cudagraphs`` stays False and the token dispatcher's state needs no round trip (the
    ``token_dispatcher_attr_outputs`` are always empty).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.is_moe_layer = True
        self.use_partial_cudagraphs = False
        self.moe_layer_recompute = False
        self._mlp_norm_manager: Any = None

    def _forward_mlp_router(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, ...]:
        """The pre-MLP norm and the MoE layer's routing half.

        Returns ``(residual, preprocessed tokens, probs, shared-expert output or None)``; ``padding_mask`` is
        ``[b, s]``, True for padding tokens.
        """
        pre_mlp_layernorm_output, residual, self._mlp_norm_manager = self._forward_pre_mlp_layernorm(hidden_states)
        tokens, probs, shared_expert_output = self.mlp.route_and_preprocess(pre_mlp_layernorm_output, padding_mask)
        return residual, tokens, probs, shared_expert_output

    def _forward_mlp_expert_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                                    token_dispatcher_attr_outputs: Any = ()) -> tuple[torch.Tensor, None]:
        """Dispatch the preprocessed tokens, run the experts and combine: ``(combined output, None)``."""
        dispatched, probs = self.mlp.dispatch(hidden_states, probs)
        output, mlp_bias = self.mlp.routed_experts_compute(dispatched, probs)
        return self.mlp.combine(output), mlp_bias

    def _forward_mlp_postprocess(self, residual: torch.Tensor, output: torch.Tensor,
                                 shared_expert_output: torch.Tensor | None,
                                 mlp_bias: torch.Tensor | None) -> torch.Tensor:
        """Unpermute, add the shared experts' output, then the MLP's bias-dropout-add onto ``residual``."""
        output = self.mlp.postprocess(output, shared_expert_output)
        manager, self._mlp_norm_manager = self._mlp_norm_manager, None
        return self._forward_post_mlp((output, mlp_bias), residual, manager)


def _builds_moe_layer(spec: Any) -> bool:
    """Whether ``spec`` builds a MoE layer (whose router needs to know it serves an MTP depth)."""
    from megatron_core.transformer.moe.moe_layer import BaseMoELayer  # lazy-import: moe builds on this module

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return isinstance(module, type) and issubclass(module, BaseMoELayer)
