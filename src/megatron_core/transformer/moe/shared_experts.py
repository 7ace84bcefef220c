"""Shared experts: a dense MLP every token goes through, next to the routed experts (Megatron-Core's ``SharedExpertMLP``).

The MLP is tensor-parallel over the dense TP group with ``ffn_hidden_size =
moe_shared_expert_intermediate_size``. With ``gate`` (Qwen-MoE style) its output is multiplied by
``sigmoid(x @ gate_weight.T)``, ``gate_weight [1, hidden]`` replicated (summed over TP under
sequence parallelism). ``moe_shared_expert_overlap`` is accepted and computes the same result
without the CUDA-stream overlap (see docs/compat.md).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.moe.moe_utils import get_default_pg_collection
from megatron_core.transformer.selective_recompute import recompute_module_enabled
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["SharedExpertMLP"]


class SharedExpertMLP(MLP):
    """A dense MLP of width ``moe_shared_expert_intermediate_size`` with an optional sigmoid gate."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, gate: bool,
                 pg_collection: Any = None, name: str | None = None) -> None:
        if config.add_bias_linear:
            raise ValueError("shared experts do not support biases: set add_bias_linear=False (as Megatron-Core)")
        config = deepcopy(config)
        config.ffn_hidden_size = config.moe_shared_expert_intermediate_size
        pgs = get_default_pg_collection(pg_collection)
        super().__init__(config=config, submodules=submodules, tp_group=pgs.tp, name=name)
        self.use_shared_expert_gate = gate
        if gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=torch.float32))
            if config.perform_initialization:
                config.init_method(self.gate_weight)
            self.gate_weight.data = self.gate_weight.data.to(config.params_dtype)
            self.gate_weight.sequence_parallel = config.sequence_parallel
        else:
            self.gate_weight = None
        self.recompute_shared_experts = recompute_module_enabled(config, "shared_experts")
        self.checkpoint_mlp = False  # a shared expert recomputes under "shared_experts", never "mlp"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The shared experts' output ``[s, b, h]`` (gated when ``gate``); with ``"shared_experts"`` in
        ``recompute_modules`` its activations are rebuilt in the backward instead of kept."""
        if self.training and self.recompute_shared_experts:
            return tensor_parallel.checkpoint(self._shared_forward, False, hidden_states)
        return self._shared_forward(hidden_states)

    def _shared_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, _ = super().forward(hidden_states)
        if self.use_shared_expert_gate:
            output = output * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
        return output
