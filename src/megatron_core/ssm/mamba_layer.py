"""One Mamba layer (Megatron-Core's ``MambaLayer``): ``x + mixer(norm(x))`` over ``[s, b, h]``.

The norm, mixer and bias-dropout-add come from :class:`MambaLayerSubmodules`. With the local spec the
norm is a separate module whose checkpoint key is renamed to Transformer Engine's fused
``mixer.in_proj.layer_norm_weight`` through ``sharded_state_dict_keys_map``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.module import GraphableMegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["MambaLayer", "MambaLayerSubmodules"]


@dataclass
class MambaLayerSubmodules:
    """Specs of a Mamba layer's input norm, mixer and bias-dropout-add, and its checkpoint key renames."""

    norm: ModuleSpec | type = IdentityOp
    mixer: ModuleSpec | type = IdentityOp
    mamba_bda: ModuleSpec | type = IdentityOp
    sharded_state_dict_keys_map: dict[str, str] = field(default_factory=dict)


class MambaLayer(GraphableMegatronModule):
    """A pre-norm residual Mamba layer; ``forward`` maps ``[s, b, h]`` to ``[s, b, h]``."""

    def __init__(self, config: TransformerConfig, submodules: MambaLayerSubmodules, layer_number: int = 1,
                 pg_collection: Any = None, pp_layer_offset: int = 0, name: str | None = None) -> None:
        super().__init__(config)
        self.pg_collection = pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = pg_collection.tp
        self.submodules_config = submodules
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.mixer = build_module(submodules.mixer, config, d_model=config.hidden_size, layer_number=layer_number,
                                  pg_collection=pg_collection, pp_layer_offset=pp_layer_offset,
                                  name=f"{name}.mixer" if name is not None else None)
        self.norm = build_module(submodules.norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)
        self.mamba_bda = build_module(submodules.mamba_bda)
        self.bias_dropout_add_exec_handler = torch.enable_grad

    def mamba_state_shapes_per_request(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The mixer's per-sequence convolution and SSM state shapes."""
        return self.mixer.mamba_state_shapes_per_request()

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the mixer's projections hold: ``config.params_dtype`` until the module is cast.

        Megatron-Core casts the layer input to ``config.params_dtype``; after a plain ``.to(torch.bfloat16)``
        of a model built in fp32 that would feed fp32 activations to bf16 weights, so the input follows
        the weights instead (identical whenever the two agree).
        """
        weight = getattr(getattr(self.mixer, "in_proj", None), "weight", None)
        return weight.dtype if isinstance(weight, torch.Tensor) else self.config.params_dtype

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                inference_context: Any = None, rotary_pos_emb: torch.Tensor | None = None, *,
                inference_params: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``hidden_states + dropout(mixer(norm(hidden_states)))``; the mask and rotary embedding are unused."""
        residual = hidden_states
        if self.config.fp32_residual_connection:
            residual = residual.float()
        hidden_states = hidden_states.to(dtype=self._compute_dtype())
        hidden_states = self.norm(hidden_states)
        out_with_bias = self.mixer(hidden_states, inference_context=inference_context,
                                   inference_params=inference_params, packed_seq_params=packed_seq_params)
        with self.bias_dropout_add_exec_handler():
            return self.mamba_bda(training=self.training, fused=self.config.bias_dropout_fusion)(
                out_with_bias, residual, self.hidden_dropout)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """The sharded state with the spec's ``sharded_state_dict_keys_map`` renames applied."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        keys_map = self.submodules_config.sharded_state_dict_keys_map
        if keys_map:
            from megatron_core.dist_checkpointing.utils import apply_prefix_mapping

            apply_prefix_mapping(sharded, {f"{prefix}{old}": f"{prefix}{new}" for old, new in keys_map.items()})
        return sharded
