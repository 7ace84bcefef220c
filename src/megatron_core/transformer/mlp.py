"""The feed-forward block (Megatron-Core's ``MLP`` + ``MLPSubmodules``).

``linear_fc1`` (column-parallel) -> activation -> ``linear_fc2`` (row-parallel). With
``gated_linear_unit`` (SwiGLU when the activation is SiLU), fc1 produces ``2 * ffn`` features
laid out as ``[gate; up]`` **per tensor-parallel shard**: each rank's shard of the fc1 weight is
``[gate_shard; up_shard]``, so the full TP=1 weight is ``[gate; up]`` only when TP = 1. fc1 is
built with ``stride=2`` (as in Megatron-Core), so CPU initialisation cuts rank ``r``'s
``[gate_r; up_r]`` out of the same master weight at every TP size. Both biases are returned
separately (``skip_bias_add``) so the caller fuses them. The TP group is ``tp_group``, else
``pg_collection.tp`` (``.expt_tp`` for experts), else ``parallel_state``'s.

In a checkpoint a gated fc1 is stored TP-independently: :meth:`MLP.sharded_state_dict` wraps its
weight and bias in a factory that saves the gate and up halves as two tensors (Megatron-Core's
``apply_swiglu_sharded_factory``), so the checkpoint reloads under any TP size.

As an MoE expert, ``forward(x, per_token_scale)`` weights each token by its routing probability
after the activation and adds the fc2 bias scaled the same way, so the output is
``p * (fc2(act(fc1(x))) + b2)`` and no bias is returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core import tensor_parallel
from megatron_core.activations import gated_linear_unit
from megatron_core.dist_checkpointing.factories import apply_swiglu_sharded_factory
from megatron_core.dist_checkpointing.mapping import ShardedTensor
from megatron_core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron_core.fusions.fused_weighted_squared_relu import (
    uses_fused_weighted_squared_relu,
    weighted_squared_relu_impl,
)
from megatron_core.tensor_parallel.delayed_wgrad import run_delayed_wgrads
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.selective_recompute import ActivationRecompute, recompute_module_enabled
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.submodule_protocols import (  # noqa: F401 (the slots' protocols, re-exported)
    LinearFc1Builder,
    LinearFc1Interface,
    LinearFc2Builder,
    LinearFc2Interface,
    TEActivationFunctionBuilder,
    TEActivationFunctionInterface,
)
from megatron_core.transformer.transformer_config import TransformerConfig


@dataclass
class MLPSubmodules:
    """The two projections of the MLP and an optional activation override."""

    linear_fc1: ModuleSpec | type | None = None
    linear_fc2: ModuleSpec | type | None = None
    activation_func: Callable[[torch.Tensor], torch.Tensor] | None = None


class MLP(MegatronModule):
    """``fc2(act(fc1(x)))`` with optional gating; input and output ``[s, b, h]``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: int | None = None,
        ffn_hidden_size: int | None = None,
        tp_group: Any = None,
        name: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config)
        # Routed experts of a latent MoE layer read and write moe_latent_size-wide tokens (as Megatron-Core).
        latent_size = config.moe_latent_size if is_expert else None
        self.input_size = latent_size or (input_size if input_size is not None else config.hidden_size)
        ffn_hidden_size = ffn_hidden_size if ffn_hidden_size is not None else config.ffn_hidden_size
        fc1_output_size = 2 * ffn_hidden_size if config.gated_linear_unit else ffn_hidden_size
        self.tp_group = resolve_tp_group(tp_group, pg_collection, is_expert)
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            self.input_size,
            fc1_output_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
            stride=2 if config.gated_linear_unit else 1,
        )
        self.activation_func = submodules.activation_func or config.activation_func
        self.gated = config.gated_linear_unit
        # GPT-OSS's GLU: act(min(gate, v)) * (clamp(up, -v, v) + offset); the fused SwiGLU has neither.
        self.glu_linear_offset = config.glu_linear_offset
        self.glu_clamp_value = config.activation_func_clamp_value
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            ffn_hidden_size,
            latent_size or config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )
        # "mlp" is the dense layer's MLP (as Megatron-Core); MoE layers have "moe", "moe_act", "shared_experts".
        self.checkpoint_mlp = not is_expert and recompute_module_enabled(config, "mlp")
        # "moe_act": an expert's activation output is rebuilt in the backward instead of kept.
        self.recompute_activation = is_expert and recompute_module_enabled(config, "moe_act")

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs ``linear_fc2`` then ``linear_fc1`` deferred (``delay_wgrad_compute``)."""
        run_delayed_wgrads(self)

    def _activate(self, intermediate: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (self.config.bias_activation_fusion and self.gated and self.activation_func is F.silu
                and self.glu_linear_offset == 0.0 and self.glu_clamp_value is None
                and not torch.compiler.is_compiling()):
            # One fused kernel each way (jit_fuser on GPUs), saving only the input; a compiled layer fuses
            # the plain expression below itself.
            return bias_swiglu_impl(intermediate, bias)
        if bias is not None:
            intermediate = intermediate + bias
        if self.gated:
            return gated_linear_unit(intermediate, self.activation_func, self.glu_linear_offset, self.glu_clamp_value)
        return self.activation_func(intermediate)

    def _activate_scaled(self, intermediate: torch.Tensor, bias: torch.Tensor | None,
                         per_token_scale: torch.Tensor | None) -> torch.Tensor:
        if per_token_scale is not None and uses_fused_weighted_squared_relu(self.config, self.activation_func):
            x = intermediate if bias is None else intermediate + bias
            return weighted_squared_relu_impl(x, per_token_scale)  # saves only its inputs
        activated = self._activate(intermediate, bias)
        if per_token_scale is None:
            return activated
        return (activated * per_token_scale.unsqueeze(-1)).to(activated.dtype)

    def _swiglu_in_fc1(self) -> bool:
        """Whether ``linear_fc1`` applies this MLP's SwiGLU itself: an FP8 layer that offers it (``fuses_swiglu``:
        its backward quantizes SwiGLU's gradient in one go), a plain SwiGLU, no activation recompute."""
        fuses = getattr(self.linear_fc1, "fuses_swiglu", None)
        return (self.gated and self.activation_func is F.silu and self.glu_linear_offset == 0.0
                and self.glu_clamp_value is None and not self.recompute_activation and fuses is not None and fuses())

    def _forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if per_token_scale is None and self._swiglu_in_fc1():
            intermediate, amax = self.linear_fc1.forward_swiglu(hidden_states)
            # an FP8 linear_fc2 takes the amax made with the activation (its scale without a pass of its own)
            if getattr(self.linear_fc2, "takes_input_amax", False):
                return self.linear_fc2(intermediate, input_amax=amax)
            return self.linear_fc2(intermediate)
        intermediate, bias = self.linear_fc1(hidden_states)
        recompute = ActivationRecompute(self.recompute_activation and self.training)
        intermediate = recompute.run(self._activate_scaled, intermediate, bias, per_token_scale)
        output, output_bias = self.linear_fc2(intermediate)
        recompute.discard(output)
        if per_token_scale is None:
            return output, output_bias
        if output_bias is not None:
            output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1).to(output.dtype)
        return output, None

    def forward(
        self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns ``(output [s, b, h], output_bias)``; ``per_token_scale`` ``[tokens]`` weights an expert's tokens."""
        if self.checkpoint_mlp and self.training:
            return tensor_parallel.checkpoint(self._forward, False, hidden_states, per_token_scale)
        return self._forward(hidden_states, per_token_scale)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The generic sharded state, with a gated fc1's ``[gate_r; up_r]`` shards split into two halves."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.config.gated_linear_unit:
            for name in ("weight", "bias"):
                key = f"{prefix}linear_fc1.{name}"
                entry = sharded.get(key)
                if isinstance(entry, ShardedTensor):
                    sharded[key] = apply_swiglu_sharded_factory(entry)
                    if hasattr(entry, "fp8_param"):  # an FP8 weight's entry names its parameter (fp8_param)
                        sharded[key].fp8_param = entry.fp8_param
        return sharded
