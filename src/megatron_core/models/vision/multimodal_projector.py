"""The vision-to-language projector of multimodal models (Megatron-Core's ``MultimodalProjector``).

Maps encoder features of width ``input_size`` to the language model's ``config.hidden_size``.
``projector_type="mlp"`` is an :class:`~megatron_core.transformer.mlp.MLP` (column-parallel fc1,
``config.activation_func``, row-parallel fc2, so the output is whole on every TP rank);
``"affine"`` is the single ``submodules.linear_fc1`` layer with its output gathered over the TP
group (its bias gathered too). Either way the bias is added here and the result is a viewless tensor (the pipeline
schedule frees outputs by their storage).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._misc_utils import make_viewless_tensor
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["MultimodalProjector"]

PROJECTOR_TYPES = ("mlp", "affine")


class MultimodalProjector(MegatronModule):
    """Projects ``[..., input_size]`` features to ``[..., config.hidden_size]`` (``"mlp"`` or ``"affine"``)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        projector_type: str,
        input_size: int,
        tp_group: Any = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"projector_type ({projector_type!r}) must be one of {list(PROJECTOR_TYPES)}")
        if submodules is None or submodules.linear_fc1 is None:
            raise ValueError("MultimodalProjector needs submodules (MLPSubmodules) with linear_fc1 set")
        self.projector_type = projector_type
        self.tp_group = resolve_tp_group(tp_group, pg_collection)
        if projector_type == "mlp":
            self.encoder = MLP(config=config, submodules=submodules, input_size=input_size, tp_group=self.tp_group)
        else:
            self.encoder = build_module(
                submodules.linear_fc1,
                input_size,
                config.hidden_size,
                config=config,
                init_method=config.init_method,
                gather_output=True,
                bias=config.add_bias_linear,
                skip_bias_add=True,
                is_expert=False,
                tp_comm_buffer_name=None,
                tp_group=self.tp_group,
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project ``hidden_states`` ``[..., input_size]`` to ``[..., hidden_size]`` (bias included)."""
        output, bias = self.encoder(hidden_states)
        if bias is not None and bias.shape[-1] != output.shape[-1]:
            # The affine layer gathers its output but returns only this rank's bias shard; gather it too
            # (Megatron-Core adds the shard and so fails at TP > 1).
            bias = gather_from_tensor_model_parallel_region(bias, self.tp_group)
        if bias is not None:
            output = output + bias
        return make_viewless_tensor(inp=output, requires_grad=True, keep_graph=True)
