"""Multi-token prediction (DeepSeek-V3's MTP; Megatron-Core's ``megatron.core.transformer.multi_token_prediction``).

After the decoder, depth ``k`` (1..``mtp_num_layers``) predicts token ``i + k + 1`` at position ``i``: it normalises
the previous depth's hidden state (``hnorm``) and the embedding of token ``i + k`` (``enorm``; the ids rolled left
``k`` times), concatenates them ``[embedding; hidden]``, projects ``2h -> h`` (``eh_proj``), runs one transformer
layer and a final norm. Every depth shares the model's embedding and output layer.

A hybrid (Mamba) model's depth runs a :class:`~megatron_core.transformer.hybrid_stack.HybridStack` over the MTP part
of its layer pattern instead (``mtp_layer_pattern`` with ``hybrid_submodules``; ``"M*M/*M/*M"`` has two depths of
``"*M"``): the stack has no final norm (the depth's ``final_layernorm`` is it) and numbers its layers from 1, and
its checkpoint keys stay ``mtp_model_layer.`` where a GPT depth's become Megatron's ``transformer_layer.``. The GPT model concatenates the
depths' hidden states after the decoder's along the sequence axis; :func:`process_mtp_loss` splits them again,
computes each depth's cross entropy against the labels rolled once more per depth (masked, averaged over the valid
positions), and attaches ``mtp_loss_scaling_factor / mtp_num_layers`` times it to the main hidden states through
:class:`MTPLossAutoScaler`, so the reported loss is the main loss and the gradients include MTP's.

Rolling respects context parallelism (each rank holds two mirrored chunks of the sequence; boundary tokens are
exchanged with the neighbouring ranks) and packed sequences (no token crosses a sequence boundary). The MTP layers
live on the last pipeline stage.

This module holds the layers, their specs and the checkpoint ties; the rest lives beside it and is re-exported
here under Megatron-Core's path: rolling in :mod:`.mtp_roll`, the stage placement in :mod:`.mtp_placement`, the
loss in :mod:`.mtp_loss` and the logged metrics in :mod:`.mtp_metrics`.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._ground.hybrid_pattern import validate_segment_layers
from megatron_core._misc_utils import make_viewless_tensor
from megatron_core.dist_checkpointing.sharded_module import make_tp_sharded_tensor_for_checkpoint
from megatron_core.dist_checkpointing.utils import apply_prefix_mapping, replace_prefix_for_sharding
from megatron_core.enums import AttnMaskType
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_core.transformer.backends import LocalSpecProvider, te_spec_provider
from megatron_core.transformer.hybrid_stack import HybridStack, HybridStackSubmodules
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.mtp_loss import MTPLossAutoScaler, process_mtp_loss
from megatron_core.transformer.mtp_metrics import MTPLossLoggingHelper
from megatron_core.transformer.mtp_placement import (
    get_mtp_layer_offset,
    get_mtp_num_layers_to_build,
    get_mtp_ranks,
    mtp_on_this_rank,
)
from megatron_core.transformer.mtp_roll import roll_tensor
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

SUPPORTED_ATTN_MASK = [AttnMaskType.padding, AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding_causal]
"""The attention mask types an MTP depth's attention may use (Megatron-Core 0.19's list)."""


def _check_mtp_attention_mask(layer_spec: Any) -> None:
    """``ValueError`` if an MTP depth's self-attention spec asks for a mask type outside ``SUPPORTED_ATTN_MASK``."""
    submodules = getattr(layer_spec, "submodules", None)
    attention = getattr(submodules, "self_attention", None)
    params = getattr(attention, "params", None) or {}
    mask_type = params.get("attn_mask_type")
    if mask_type is not None and mask_type not in SUPPORTED_ATTN_MASK:
        raise ValueError(f"multi-token prediction does not support attn_mask_type={mask_type} in its layer's "
                         f"self_attention spec; supported: {[m.name for m in SUPPORTED_ATTN_MASK]}")


__all__ = [
    "SUPPORTED_ATTN_MASK",
    "MTPLossAutoScaler",
    "MTPLossLoggingHelper",
    "MultiTokenPredictionBlock",
    "MultiTokenPredictionBlockSubmodules",
    "MultiTokenPredictionLayer",
    "MultiTokenPredictionLayerSubmodules",
    "get_mtp_layer_offset",
    "get_mtp_layer_spec",
    "get_mtp_layer_spec_for_backend",
    "get_mtp_num_layers_to_build",
    "get_mtp_ranks",
    "mtp_on_this_rank",
    "process_mtp_loss",
    "roll_tensor",
    "tie_output_layer_state_dict",
    "tie_word_embeddings_state_dict",
]


# --- checkpoint ties ---------------------------------------------------------------------------------------------
def _retie(sharded_state_dict: dict, weight: torch.Tensor, key: str, tp_group: Any, dp_cp_group: Any) -> None:
    if key not in sharded_state_dict:
        raise KeyError(f"{key} is not in the sharded state dict")
    # Replica 1 on the pipeline axis: the copy on the MTP stage, saved by the stage that owns the original.
    sharded = make_tp_sharded_tensor_for_checkpoint(weight, key, tp_group=tp_group, dp_cp_group=dp_cp_group,
                                                    allow_shape_mismatch=True)
    sharded.replica_id = (1, *sharded.replica_id[1:])
    sharded_state_dict[key] = sharded


def tie_word_embeddings_state_dict(sharded_state_dict: dict, word_emb_weight: torch.Tensor, word_emb_weight_key: str,
                                   tp_group: Any = None, dp_cp_group: Any = None) -> None:
    """Mark the MTP stage's copy of the word embedding as a replica of the first stage's (in place)."""
    _retie(sharded_state_dict, word_emb_weight, word_emb_weight_key, tp_group, dp_cp_group)


def tie_output_layer_state_dict(sharded_state_dict: dict, output_layer_weight: torch.Tensor,
                                output_layer_weight_key: str, tp_group: Any = None, dp_cp_group: Any = None) -> None:
    """Mark the MTP stage's copy of the output layer as a replica of the last stage's (in place)."""
    _retie(sharded_state_dict, output_layer_weight, output_layer_weight_key, tp_group, dp_cp_group)


# --- layers ------------------------------------------------------------------------------------------------------
@dataclass
class MultiTokenPredictionLayerSubmodules:
    """The norms of the embedding (``enorm``) and hidden state (``hnorm``), the ``2h -> h`` projection, the
    transformer layer and the final norm (``layer_norm``) of one MTP depth."""

    enorm: Any = None
    hnorm: Any = None
    layer_norm: Any = None
    eh_proj: ModuleSpec | type | None = None
    mtp_model_layer: ModuleSpec | type | None = None


def get_mtp_layer_spec_for_backend(mtp_model_layer_spec: ModuleSpec | None, backend: Any) -> ModuleSpec:
    """An MTP layer spec with ``backend``'s norm and column-parallel linear around ``mtp_model_layer_spec``."""
    norm = backend.layer_norm()
    return ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, layer_norm=norm, eh_proj=backend.column_parallel_linear(),
        mtp_model_layer=mtp_model_layer_spec))


def get_mtp_layer_spec(mtp_model_layer_spec: ModuleSpec, use_transformer_engine: bool) -> ModuleSpec:
    """An MTP layer spec for the Transformer Engine (``use_transformer_engine``) or the local backend."""
    backend = te_spec_provider() if use_transformer_engine else LocalSpecProvider()
    return get_mtp_layer_spec_for_backend(mtp_model_layer_spec, backend)


def _hybrid_submodules_arg(hybrid_submodules: HybridStackSubmodules | None,
                           mamba_submodules: HybridStackSubmodules | None) -> HybridStackSubmodules | None:
    """``hybrid_submodules``, or the deprecated ``mamba_submodules`` (Megatron-Core's earlier name) in its place."""
    if mamba_submodules is None:
        return hybrid_submodules
    if hybrid_submodules is not None:
        raise ValueError("hybrid_submodules and mamba_submodules cannot both be set; mamba_submodules is the "
                         "deprecated name of hybrid_submodules")
    warnings.warn("mamba_submodules is deprecated; use hybrid_submodules", DeprecationWarning, stacklevel=3)
    return mamba_submodules


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP depth: ``final_norm(layer(eh_proj([enorm(embed(ids rolled)); hnorm(h)])))`` (module docstring).

    ``layer`` is ``submodules.mtp_model_layer`` (a transformer layer), or with ``mtp_layer_pattern`` and
    ``hybrid_submodules`` a hybrid stack of that pattern's layers.
    """

    def __init__(self, config: TransformerConfig, submodules: MultiTokenPredictionLayerSubmodules,
                 layer_number: int = 1, vp_stage: int | None = None, pg_collection: Any = None,
                 mtp_layer_pattern: str | None = None, hybrid_submodules: HybridStackSubmodules | None = None,
                 mamba_submodules: HybridStackSubmodules | None = None, name: str | None = None,
                 **unused: Any) -> None:
        super().__init__(config)
        hybrid_submodules = _hybrid_submodules_arg(hybrid_submodules, mamba_submodules)
        if mtp_layer_pattern is not None and hybrid_submodules is None:
            raise ValueError(f"mtp_layer_pattern ({mtp_layer_pattern!r}) needs hybrid_submodules (the hybrid stack's "
                             "layer specs, HybridStackSubmodules) to build the depth's layers from")
        pg_collection = resolve_pg_collection(pg_collection)
        self.submodules = submodules
        self.sequence_parallel = config.sequence_parallel
        self.layer_number = layer_number + get_mtp_layer_offset(config, vp_stage)
        self.vp_stage = vp_stage
        self.cp_group, self.tp_group = pg_collection.cp, pg_collection.tp
        self.mtp_layer_pattern = mtp_layer_pattern
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.enorm = build_module(submodules.enorm, **norm_kwargs)
        self.hnorm = build_module(submodules.hnorm, **norm_kwargs)
        self.eh_proj = build_module(
            submodules.eh_proj, 2 * config.hidden_size, config.hidden_size, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="mtp_eh_proj", tp_group=self.tp_group)
        _check_mtp_attention_mask(hybrid_submodules.attention_layer if mtp_layer_pattern is not None
                                  else submodules.mtp_model_layer)
        if mtp_layer_pattern is not None:
            # The depth's own final_layernorm ends it, so the stack has none; its layers are numbered from 1.
            self.mtp_model_layer = HybridStack(
                config, hybrid_submodules, pre_process=True, layer_type_list=validate_segment_layers(mtp_layer_pattern),
                pp_layer_offset=0, post_layer_norm=False, post_process=True, pg_collection=pg_collection,
                is_mtp_layer=True, name=None if name is None else f"{name}.mtp_model_layer")
        else:
            self.mtp_model_layer = build_module(submodules.mtp_model_layer, config=config,
                                                layer_number=self.layer_number, vp_stage=vp_stage, is_mtp_layer=True,
                                                pg_collection=pg_collection)
        self.final_layernorm = build_module(submodules.layer_norm, **norm_kwargs)

    def _inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, padding_mask: torch.Tensor | None,
                embedding: Any, packed_seq_params: Any) -> tuple:
        input_ids, _ = roll_tensor(input_ids, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
        position_ids, _ = roll_tensor(position_ids, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
        if padding_mask is not None:
            padding_mask, _ = roll_tensor(padding_mask, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        if self.config.mtp_detach_heads:
            decoder_input = decoder_input.detach()
        return input_ids, position_ids, padding_mask, decoder_input

    def _project(self, hidden_states: torch.Tensor, decoder_input: torch.Tensor) -> torch.Tensor:
        combined = torch.cat((self.enorm(decoder_input), self.hnorm(hidden_states)), dim=-1)
        projected, _ = self.eh_proj(combined)
        projected = gather_from_tensor_model_parallel_region(projected, group=self.tp_group)
        if self.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected, group=self.tp_group)
        return projected

    def _project_and_layer(self, hidden_states: torch.Tensor, decoder_input: torch.Tensor,
                           **layer_kwargs: Any) -> torch.Tensor:
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.sequence_parallel else nullcontext()
        with rng:
            hidden_states = self._project(hidden_states, decoder_input)
            if self.mtp_layer_pattern is not None:  # a hybrid stack: no separate cos/sin, returns the states alone
                layer_kwargs.pop("rotary_pos_cos", None)
                layer_kwargs.pop("rotary_pos_sin", None)
                hidden_states = self.mtp_model_layer(hidden_states=hidden_states, **layer_kwargs)
            else:
                hidden_states, _ = self.mtp_model_layer(hidden_states=hidden_states, **layer_kwargs)
        hidden_states = self.final_layernorm(hidden_states)
        return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None, padding_mask: torch.Tensor | None = None, context: Any = None,
                context_mask: Any = None, rotary_pos_emb: torch.Tensor | None = None,
                rotary_pos_cos: torch.Tensor | None = None, rotary_pos_sin: torch.Tensor | None = None,
                attention_bias: Any = None, inference_params: Any = None, packed_seq_params: Any = None,
                sequence_len_offset: Any = None, embedding: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(this depth's hidden states [s, b, h], ids, positions and padding mask rolled once more)``."""
        if context is not None:
            raise ValueError("multi-token prediction with cross-attention (context) is not supported")
        input_ids, position_ids, padding_mask, decoder_input = self._inputs(
            input_ids, position_ids, padding_mask, embedding, packed_seq_params)
        layer_kwargs = dict(attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                            packed_seq_params=packed_seq_params)
        if rotary_pos_cos is not None or rotary_pos_sin is not None:
            layer_kwargs.update(rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin)
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = tensor_parallel.checkpoint(
                lambda h, d: self._project_and_layer(h, d, **layer_kwargs), self.config.distribute_saved_activations,
                hidden_states, decoder_input)
        else:
            hidden_states = self._project_and_layer(hidden_states, decoder_input, **layer_kwargs)
        return hidden_states, input_ids, position_ids, padding_mask

    def forward_single_position(self, hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                                position_ids: torch.Tensor, embedding: Any, attention_mask: torch.Tensor | None = None,
                                rotary_pos_emb: torch.Tensor | None = None, rotary_pos_cos: Any = None,
                                rotary_pos_sin: Any = None, packed_seq_params: Any = None,
                                sequence_len_offset: Any = None) -> torch.Tensor:
        """This depth's hidden states ``[s, b, h]`` given the tokens that follow ``hidden_states`` (speculative drafting).

        Unlike :meth:`forward` nothing is rolled: ``next_token_ids`` / ``position_ids`` ``[b, s]`` are the tokens
        whose embeddings pair with ``hidden_states`` ``[s, b, h]`` position for position.
        """
        decoder_input = embedding(input_ids=next_token_ids, position_ids=position_ids)
        layer_kwargs: dict[str, Any] = dict(attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                            packed_seq_params=packed_seq_params)
        if rotary_pos_cos is not None or rotary_pos_sin is not None:
            layer_kwargs.update(rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin)
        return self._project_and_layer(hidden_states, decoder_input, **layer_kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The generic sharded state; a GPT depth's transformer layer is saved as ``transformer_layer.`` (Megatron's
        key), a hybrid depth's stack keeps ``mtp_model_layer.``."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.mtp_layer_pattern is None:
            apply_prefix_mapping(sharded, {f"{prefix}mtp_model_layer.": f"{prefix}transformer_layer."})
        return sharded


@dataclass
class MultiTokenPredictionBlockSubmodules:
    """One MTP layer spec per depth."""

    layer_specs: list[ModuleSpec] | None = None


def _block_submodules(spec: Any) -> MultiTokenPredictionBlockSubmodules:
    if isinstance(spec, MultiTokenPredictionBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and issubclass(spec.module,
                                                                                        MultiTokenPredictionBlock):
        return spec.submodules
    raise ValueError(f"mtp_block_spec must be MultiTokenPredictionBlockSubmodules or a ModuleSpec of "
                     f"MultiTokenPredictionBlock, got {type(spec).__name__}")


class MultiTokenPredictionBlock(MegatronModule):
    """The ``mtp_num_layers`` MTP depths, run one after the other (one shared layer with ``mtp_use_repeated_layer``).

    A GPT model builds one layer per spec of ``spec``. A hybrid model passes ``mtp_layer_pattern`` (one depth's
    layer symbols), ``mtp_num_depths`` and ``hybrid_submodules``: each depth is then a layer of ``spec``'s (last)
    layer spec running a hybrid stack of that pattern, and ``mtp_num_depths`` must equal ``mtp_num_layers``.
    """

    def __init__(self, config: TransformerConfig, spec: Any, vp_stage: int | None = None, pg_collection: Any = None,
                 mtp_layer_pattern: str | None = None, mtp_num_depths: int = 0,
                 hybrid_submodules: HybridStackSubmodules | None = None,
                 mamba_submodules: HybridStackSubmodules | None = None, name: str | None = None,
                 **unused: Any) -> None:
        super().__init__(config)
        if not config.mtp_num_layers:
            raise ValueError("MultiTokenPredictionBlock needs mtp_num_layers >= 1")
        hybrid_submodules = _hybrid_submodules_arg(hybrid_submodules, mamba_submodules)
        self.submodules = _block_submodules(spec)
        if not self.submodules.layer_specs:
            raise ValueError("MultiTokenPredictionBlock needs at least one layer spec")
        self.mtp_loss_scaling_factor = config.mtp_loss_scaling_factor
        self.mtp_use_repeated_layer = config.mtp_use_repeated_layer
        self.mtp_layer_pattern, self.mtp_num_depths = mtp_layer_pattern, mtp_num_depths
        self.hybrid_submodules = hybrid_submodules
        self.vp_stage = vp_stage
        pg_collection = resolve_pg_collection(pg_collection)
        self.cp_group = pg_collection.cp
        specs = self.submodules.layer_specs
        hybrid: dict[str, Any] = {}
        if mtp_layer_pattern is not None and hybrid_submodules is not None:
            depths = mtp_num_depths or config.mtp_num_layers
            if depths != config.mtp_num_layers:
                raise ValueError(f"the hybrid MTP pattern has {depths} depths (mtp_num_depths) but "
                                 f"config.mtp_num_layers is {config.mtp_num_layers}; they must match (Megatron-LM "
                                 "sets mtp_num_layers from the hybrid_layer_pattern's '/' parts)")
            specs = [specs[min(i, len(specs) - 1)] for i in range(depths)]
            hybrid = dict(mtp_layer_pattern=mtp_layer_pattern, hybrid_submodules=hybrid_submodules)
        if self.mtp_use_repeated_layer:
            specs = specs[:1]
        self.layers = torch.nn.ModuleList([
            build_module(layer_spec, config=config, layer_number=i + 1, vp_stage=vp_stage,
                         pg_collection=pg_collection, **hybrid)
            for i, layer_spec in enumerate(specs)
        ])
        if config.mtp_detach_heads:
            for param in self.parameters():
                param.grad_norm_group = "mtp"

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None, padding_mask: torch.Tensor | None = None,
                extra_block_kwargs: dict | None = None, embedding: Any = None, **layer_kwargs: Any) -> torch.Tensor:
        """The decoder's hidden states followed by each depth's, concatenated along the sequence ``[(1 + D) s, b, h]``."""
        offset = get_mtp_layer_offset(self.config, self.vp_stage)
        parts = list(torch.chunk(hidden_states, 1 + offset, dim=0))
        hidden_states = parts[offset].detach() if self.config.mtp_detach_heads else parts[offset]
        for depth in range(self.config.mtp_num_layers):
            layer = self.layers[0 if self.mtp_use_repeated_layer else depth]
            hidden_states, input_ids, position_ids, padding_mask = layer(
                input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                attention_mask=attention_mask, padding_mask=padding_mask, embedding=embedding,
                **layer_kwargs, **(extra_block_kwargs or {}))
            parts.append(hidden_states)
        return torch.cat(parts, dim=0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Each depth under ``layers.<global depth - 1>.`` (global across pipeline stages)."""
        out: dict = {}
        offset = get_mtp_layer_offset(self.config, self.vp_stage)
        for layer in self.layers:
            local = f"{prefix}layers.{layer.layer_number - 1 - offset}."
            sharded = layer.sharded_state_dict(local, (), metadata)
            replace_prefix_for_sharding(sharded, local, f"{prefix}layers.{layer.layer_number - 1}.")
            out.update(sharded)
        return out
