"""The hybrid layer stack (Megatron-Core's ``models.hybrid.hybrid_block.HybridStack``, alias ``MambaStack``).

Builds one layer per symbol of this pipeline segment's pattern (``M`` Mamba, ``*`` attention, ``-`` MLP,
``E`` MoE, ...) from :class:`HybridStackSubmodules`, runs them in order over ``[s, b, h]`` and applies
the final norm on the last stage. Checkpoint keys use each layer's global index
(``decoder.layers.<global>.``), so checkpoints reshard across pipeline layouts. A hybrid multi-token
prediction depth runs one too (``is_mtp_layer``, no final norm of its own, layers numbered from 1).
Full activation recompute (``recompute_granularity="full"``, in training) runs the layers through
:func:`megatron_core.recompute.checkpointed_forward`, as ``TransformerBlock`` does.

It builds every layer from its spec and imports only transformer-level code, so it lives in
``transformer`` (where :mod:`.multi_token_prediction` can build it); Megatron-Core's paths
(``models.hybrid.hybrid_block``, ``ssm.mamba_block``) and ``ssm.hybrid_stack`` re-export it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_core._ground.hybrid_pattern import Symbols
from megatron_core._misc_utils import make_viewless_tensor
from megatron_core.dist_checkpointing.sharded_module import (
    sharded_state_dict_default,
    sharded_state_dict_for_layers,
)
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.transformer.full_recompute import checkpointed_forward
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayer

__all__ = ["HybridStack", "HybridStackSubmodules", "MambaStack", "MambaStackSubmodules"]


@dataclass
class HybridStackSubmodules:
    """The spec of each layer kind of a hybrid stack (and the MTP block's, unused by the stack itself)."""

    mamba_layer: ModuleSpec | type = IdentityOp
    gdn_layer: ModuleSpec | type = IdentityOp
    attention_layer: ModuleSpec | type = IdentityOp
    dsa_layer: ModuleSpec | type = IdentityOp
    mla_layer: ModuleSpec | type = IdentityOp
    mlp_layer: ModuleSpec | type = IdentityOp
    moe_layer: ModuleSpec | type = IdentityOp
    mtp_block_spec: ModuleSpec | None = None


_SLOTS = {
    Symbols.MAMBA: "mamba_layer", Symbols.GDN: "gdn_layer", Symbols.ATTENTION: "attention_layer",
    Symbols.DS_ATTENTION: "dsa_layer", Symbols.MLA: "mla_layer", Symbols.MLP: "mlp_layer", Symbols.MOE: "moe_layer",
}
_ATTENTION_KINDS = {Symbols.ATTENTION, Symbols.DS_ATTENTION, Symbols.MLA}


class HybridStack(MegatronModule):
    """The layers of one pipeline segment of a hybrid (Mamba / attention / MLP / MoE) model.

    ``layer_type_list`` (required) is this segment's symbols and ``pp_layer_offset`` the global index of
    its first layer; :class:`~megatron_core.models.hybrid.hybrid_model.HybridModel` computes both.
    """

    def __init__(self, config: TransformerConfig, submodules: HybridStackSubmodules, pre_process: bool = True,
                 layer_type_list: list[str] | None = None, pp_layer_offset: int = 0, post_layer_norm: bool = True,
                 post_process: bool = True, device: Any = None, dtype: torch.dtype | None = None,
                 pg_collection: Any = None, is_mtp_layer: bool = False, name: str | None = None) -> None:
        super().__init__(config)
        if layer_type_list is None:
            raise ValueError("HybridStack needs layer_type_list (this pipeline segment's layer symbols, computed "
                             "from the hybrid layer pattern by HybridModel)")
        self.pg_collection = pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group, self.pp_group = pg_collection.tp, getattr(pg_collection, "pp", None)
        self.pre_process, self.post_process, self.post_layer_norm = pre_process, post_process, post_layer_norm
        self.is_mtp_layer = is_mtp_layer
        self.input_tensor = None
        self.layer_type_list = list(layer_type_list)
        self.layers = nn.ModuleList()
        for i, symbol in enumerate(self.layer_type_list):
            if symbol not in _SLOTS:
                raise ValueError(f"layer_type_list[{i}] = {symbol!r} is not a layer symbol "
                                 f"(valid: {sorted(_SLOTS)})")
            spec = getattr(submodules, _SLOTS[symbol])
            kwargs: dict[str, Any] = dict(config=config, layer_number=i + 1 + pp_layer_offset,
                                          pg_collection=pg_collection)
            if symbol == Symbols.MAMBA:
                kwargs["pp_layer_offset"] = pp_layer_offset
            else:
                kwargs["add_layer_offset"] = False
            if symbol in _ATTENTION_KINDS:
                kwargs["is_mtp_layer"] = is_mtp_layer
            if name is not None:
                kwargs["name"] = f"{name}.layers.{i}"
            self.layers.append(build_module(spec, **kwargs))
        self.num_layers_per_pipeline_rank = len(self.layers)
        if post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """Use ``input_tensor`` (the previous pipeline stage's output) instead of ``forward``'s input."""
        self.input_tensor = input_tensor

    def mamba_state_shapes_per_request(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The first Mamba layer's per-sequence state shapes, or None when this segment has none."""
        for symbol, layer in zip(self.layer_type_list, self.layers):
            if symbol == Symbols.MAMBA:
                return layer.mamba_state_shapes_per_request()
        return None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                inference_context: Any = None, rotary_pos_emb: torch.Tensor | None = None, *,
                inference_params: Any = None, packed_seq_params: Any = None,
                padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer over ``[s, b, h]``, then the final norm (last stage).

        ``inference_context`` (a dynamic context) reaches every layer: attention layers use its paged KV
        cache, Mamba layers its per-request state slots.
        """
        inference_context = inference_context if inference_context is not None else inference_params
        if not self.pre_process:
            hidden_states = self.input_tensor
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = checkpointed_forward(
                self, hidden_states, attention_mask, None, None, rotary_pos_emb, None, packed_seq_params,
                use_inner_quantization_context=False, padding_mask=padding_mask)
            return self._finish(hidden_states)
        for layer in self.layers:
            if isinstance(layer, TransformerLayer):
                hidden_states, _ = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                         rotary_pos_emb=rotary_pos_emb, inference_context=inference_context,
                                         packed_seq_params=packed_seq_params)
            else:
                hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                      inference_context=inference_context, packed_seq_params=packed_seq_params)
            if isinstance(hidden_states, tuple):
                hidden_states = hidden_states[0]
        return self._finish(hidden_states)

    def _finish(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The final norm (last stage), as a viewless tensor for the pipeline's send."""
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_norm(hidden_states)
        return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """Each layer under its global index (``<prefix>layers.<global>.``), then the final norm."""
        indices = [layer.layer_number - 1 for layer in self.layers]
        total = max(indices, default=-1) + 1
        sharded = sharded_state_dict_for_layers(self.layers, f"{prefix}layers.", indices, total, sharded_offsets,
                                                metadata, stacked=False)
        for child_name, module in self.named_children():
            if module is self.layers:
                continue
            child_prefix = f"{prefix}{child_name}."
            if hasattr(module, "sharded_state_dict"):
                sharded.update(module.sharded_state_dict(child_prefix, sharded_offsets, metadata))
            else:
                sharded.update(sharded_state_dict_default(module, child_prefix, sharded_offsets, metadata,
                                                          tp_group=self.tp_group))
        return sharded


MambaStackSubmodules = HybridStackSubmodules
MambaStack = HybridStack
