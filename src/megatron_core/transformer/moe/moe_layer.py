"""The mixture-of-experts block that replaces a layer's MLP (Megatron-Core's ``MoELayer`` + ``MoESubmodules``).

``forward(hidden_states [s, b, h])`` returns ``(output [s, b, h], None)``: shared experts (if any)
on the input, the router's ``(probs, routing_map)``, dispatch to the ranks holding each expert,
the routed experts, combine, and the sum of routed and shared outputs. Process groups come from the
package resolver: ``pg_collection`` (roles ``ep``, ``expt_tp``, ``tp_ep``, ``expt_dp``, ``tp``, ``tp_cp``,
``tp_dp_cp``; an unset role means no parallelism) when given, else ``parallel_state``. Sizes come from
the groups; ``num_moe_experts`` must be divisible by the EP group size, and
``expert_model_parallel_size`` / ``expert_tensor_parallel_size`` must not contradict the groups.

With ``InferenceTopKRouter`` under an inference engine the router returns dense ``[tokens, topk]`` routing:
experts that take it (``InferenceGroupedMLP``) run on the tokens directly when neither expert parallelism nor
expert tensor parallelism splits them, and otherwise through the inference dispatcher that
``inference_moe_token_dispatcher_type`` names (:mod:`.token_dispatcher_inference`: all-gather, local experts,
reduce-scatter over ``tp_ep``); with experts that do not take it, the routing becomes the usual
``[tokens, num_experts]`` map and goes through the token dispatcher. The slots' typing protocols are in
:mod:`.submodule_protocols`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.process_groups_config import check_parallel_size
from megatron_core.tensor_parallel.delayed_wgrad import enable_delayed_wgrad
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.moe.experts_wgrad_overlap import (
    mark_experts_dgrad_done,
    run_experts_wgrad_after_dispatch_backward,
)
from megatron_core.transformer.moe.latent_projection import LatentProjection
from megatron_core.transformer.moe.moe_utils import get_default_pg_collection
from megatron_core.transformer.moe.router import TopKRouter, is_dense_routing, sparse_routing_from_dense
from megatron_core.transformer.moe.submodule_protocols import (
    ExpertsBuilder,
    ExpertsInterface,
    RouterBuilder,
    RouterInterface,
    SharedExpertsBuilder,
    SharedExpertsInterface,
)
from megatron_core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron_core.transformer.moe.token_dispatcher_inference import inference_dispatcher_class
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["BaseMoELayer", "ExpertsBuilder", "ExpertsInterface", "MoELayer", "MoESubmodules", "RouterBuilder",
           "RouterInterface", "SharedExpertsBuilder", "SharedExpertsInterface"]

_DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}


@dataclass
class MoESubmodules:
    """Specs of the routed experts, the optional shared experts and the router."""

    experts: ModuleSpec | type | None = None
    shared_experts: ModuleSpec | type | None = None
    router: ModuleSpec | type = TopKRouter


class BaseMoELayer(MegatronModule):
    """Expert bookkeeping shared by MoE layers: which experts live on this EP rank."""

    def __init__(self, config: TransformerConfig, layer_number: int | None = None, pg_collection: Any = None,
                 is_mtp_layer: bool = False) -> None:
        super().__init__(config)
        self.pg_collection = get_default_pg_collection(pg_collection)
        self.layer_number = layer_number
        self.is_mtp_layer = is_mtp_layer
        self.ep_group, self.attn_tp_group = self.pg_collection.ep, self.pg_collection.tp
        ep_size, ep_rank = get_pg_size(self.ep_group), get_pg_rank(self.ep_group)
        check_parallel_size(config, "expert_model_parallel_size", self.ep_group, "expert-parallel")
        if config.expert_tensor_parallel_size != config.tensor_model_parallel_size:
            check_parallel_size(config, "expert_tensor_parallel_size", self.pg_collection.expt_tp,
                                "expert tensor-parallel")
        if config.num_moe_experts % ep_size != 0:
            raise ValueError(f"num_moe_experts ({config.num_moe_experts}) must be divisible by the expert-parallel "
                             f"group size ({ep_size})")
        self.num_local_experts = config.num_moe_experts // ep_size
        self.local_expert_indices = [ep_rank * self.num_local_experts + i for i in range(self.num_local_experts)]
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        self.shared_expert_overlap = config.moe_shared_expert_overlap
        self.router: Any = None
        self.experts: Any = None
        self.shared_experts: Any = None
        self.token_dispatcher: Any = None

    def set_layer_number(self, layer_number: int) -> None:
        """The global 1-based layer number (for per-layer aux-loss logging)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)


class MoELayer(BaseMoELayer):
    """Router + token dispatcher + routed experts (+ shared experts)."""

    def __init__(self, config: TransformerConfig, submodules: MoESubmodules | None = None,
                 layer_number: int | None = None, pg_collection: Any = None, is_mtp_layer: bool = False,
                 name: str | None = None) -> None:
        if submodules is None or submodules.experts is None:
            raise ValueError("MoELayer needs submodules with an experts spec (see get_moe_module_spec)")
        super().__init__(config, layer_number, pg_collection, is_mtp_layer)
        self.submodules = submodules
        pgs = self.pg_collection
        self.moe_layer_recompute = config.recompute_granularity == "selective" and "moe" in config.recompute_modules
        self.router = build_module(submodules.router, config=config, pg_collection=pgs, is_mtp_layer=is_mtp_layer)
        if config.moe_latent_size:  # tokens travel and are computed at moe_latent_size (see .latent_projection)
            self.fc1_latent_proj = LatentProjection(config.hidden_size, config.moe_latent_size, config,
                                                    config.init_method, config.add_bias_linear, tp_group=pgs.tp)
            self.fc2_latent_proj = LatentProjection(config.moe_latent_size, config.hidden_size, config,
                                                    config.output_layer_init_method, config.add_bias_linear,
                                                    tp_group=pgs.tp)
        self.token_dispatcher = _DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pgs)
        self.experts = build_module(submodules.experts, self.num_local_experts, config, pg_collection=pgs)
        self.token_dispatcher.expert_row_alignment = getattr(self.experts, "input_row_alignment", None)
        self._inference_token_dispatcher = None  # dense inference routing over tp_ep > 1 (see the module docstring)
        if getattr(self.experts, "takes_dense_routing", False) and get_pg_size(self.token_dispatcher.tp_ep_group) > 1:
            self._inference_token_dispatcher = inference_dispatcher_class(config)(
                self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pgs)
        if self.use_shared_expert:
            if submodules.shared_experts is None:
                raise ValueError("moe_shared_expert_intermediate_size is set but the spec has no shared_experts")
            self.shared_experts = build_module(submodules.shared_experts, config=config, pg_collection=pgs,
                                               gate=config.moe_shared_expert_gate)
        if layer_number is not None:
            self.router.set_layer_number(layer_number)
        if config.overlap_dispatch_backward_with_experts_wgrad:
            enable_delayed_wgrad(self.experts)

    def route(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """``(probs, routing_map)`` ``[s * b, num_experts]``."""
        return self.router(hidden_states, padding_mask)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """The dispatcher's local preprocessing (flatten, permute), after the down projection of a latent layer."""
        if self.config.moe_latent_size:
            hidden_states, _ = self.fc1_latent_proj(hidden_states)
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send tokens to the ranks of their experts (with ``overlap_dispatch_backward_with_experts_wgrad``, the
        experts' deferred weight gradients run once this all-to-all's backward has been issued)."""
        if self.config.overlap_dispatch_backward_with_experts_wgrad:
            hidden_states = run_experts_wgrad_after_dispatch_backward(self, hidden_states)
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def shared_experts_compute(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output, or None."""
        if not self.use_shared_expert:
            return None
        return self.shared_experts(hidden_states)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Run the local experts on the dispatched tokens; returns ``(output, None)`` ready for the combine."""
        if self.config.overlap_dispatch_backward_with_experts_wgrad:
            hidden_states = mark_experts_dgrad_done(self, hidden_states)
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
        expert_output, _ = self.experts(dispatched, tokens_per_expert, permuted_probs)
        return self.token_dispatcher.combine_preprocess(expert_output), None

    def combine(self, output: torch.Tensor) -> torch.Tensor:
        """Bring expert outputs back to the ranks that own the tokens."""
        return self.token_dispatcher.token_combine(output)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None) -> torch.Tensor:
        """Unpermute to ``[s, b, h]`` (projecting a latent layer's output back up) and add the shared experts'."""
        output = self.token_dispatcher.combine_postprocess(output)
        if self.config.moe_latent_size:
            output, _ = self.fc2_latent_proj(output)
        return output if shared_expert_output is None else output + shared_expert_output

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False) -> None:
        """Run deferred weight-gradient GEMMs: the routed experts' (``routed_experts``, the ``mlp`` slot of the
        combined 1F1B schedule) and the shared experts' (``shared_experts``, the attention slot)."""
        if routed_experts:
            self.experts.backward_dw()
        if shared_experts and self.shared_experts is not None:
            self.shared_experts.backward_dw()

    def route_and_preprocess(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The routing half of the forward on ``[s, b, h]``: ``(preprocessed tokens, probs, shared-expert output)``.

        ``padding_mask`` is ``[b, s]`` (True for padding). Dense inference routing is turned into the routing map
        the dispatcher takes. :class:`~megatron_core.transformer.transformer_layer.MoETransformerLayer`'s router
        step runs this; :meth:`dispatch`, :meth:`routed_experts_compute`, :meth:`combine` and :meth:`postprocess`
        complete the forward.
        """
        self._check_forward()
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        if is_dense_routing(routing_map):
            probs, routing_map = sparse_routing_from_dense(probs, routing_map, self.config.num_moe_experts)
        hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
        return hidden_states, probs, shared_expert_output

    def _dense_experts_apply(self) -> bool:
        """Whether dense ``[tokens, topk]`` routing can go to the experts without the dispatcher."""
        return (getattr(self.experts, "takes_dense_routing", False) and get_pg_size(self.ep_group) == 1
                and get_pg_size(self.pg_collection.expt_tp) == 1)

    def _dense_forward(self, hidden_states: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor,
                       shared_expert_output: torch.Tensor | None) -> torch.Tensor:
        """The experts on every token of ``hidden_states [s, b, h]`` with dense routing; ``[s, b, h]``."""
        if self.config.moe_latent_size:
            hidden_states, _ = self.fc1_latent_proj(hidden_states)
        shape = hidden_states.shape
        output, _ = self.experts(hidden_states.reshape(-1, shape[-1]), None, probs, indices)
        output = output.reshape(*shape[:-1], output.shape[-1])
        if self.config.moe_latent_size:
            output, _ = self.fc2_latent_proj(output)
        return output if shared_expert_output is None else output + shared_expert_output

    def _dispatched_dense_forward(self, hidden_states: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor,
                                  shared_expert_output: torch.Tensor | None) -> torch.Tensor:
        """Dense routing through the inference dispatcher: every ``tp_ep`` rank's tokens meet the local experts."""
        dispatcher = self._inference_token_dispatcher
        if self.config.moe_latent_size:
            hidden_states, _ = self.fc1_latent_proj(hidden_states)
        tokens, probs = dispatcher.dispatch_preprocess(hidden_states, indices, probs)
        tokens, probs = dispatcher.token_dispatch(tokens, probs)
        tokens, _, probs = dispatcher.dispatch_postprocess(tokens, probs)
        output, _ = self.experts(tokens, None, probs, routing_map=dispatcher.routing_map)
        output = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(output)))
        if self.config.moe_latent_size:
            output, _ = self.fc2_latent_proj(output)
        return output if shared_expert_output is None else output + shared_expert_output

    def _forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        if is_dense_routing(routing_map):
            if self._dense_experts_apply():
                return self._dense_forward(hidden_states, probs, routing_map, shared_expert_output), None
            if self._inference_token_dispatcher is not None:
                return self._dispatched_dense_forward(hidden_states, probs, routing_map, shared_expert_output), None
            probs, routing_map = sparse_routing_from_dense(probs, routing_map, self.config.num_moe_experts)
        hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched, probs = self.dispatch(hidden_states, probs)
        output, _ = self.routed_experts_compute(dispatched, probs)
        return self.postprocess(self.combine(output), shared_expert_output), None

    def _check_forward(self) -> None:
        if self.training and get_pg_size(self.attn_tp_group) > 1 and not self.config.sequence_parallel:
            raise ValueError(
                f"MoE with tensor parallelism (TP={get_pg_size(self.attn_tp_group)}) needs sequence_parallel=True "
                "during training, as in Megatron-Core"
            )

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """``(output [s, b, h], None)``; ``padding_mask [b, s]`` is True for padding tokens."""
        self._check_forward()
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.moe_layer_recompute and self.training:
            return tensor_parallel.checkpoint(self._forward, False, hidden_states, padding_mask)
        return self._forward(hidden_states, padding_mask)
