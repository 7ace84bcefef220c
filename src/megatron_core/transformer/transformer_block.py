"""A stack of transformer layers for one pipeline chunk (Megatron-Core's ``TransformerBlock``).

The block builds only the layers of this pipeline rank / virtual stage (see
``pipeline_layout``), numbered globally, plus the final norm on the last stage (with standalone MTP
stages, on the stage of the last decoder layer); an empty chunk returns a copy of its input. On a stage
that does not hold the embedding, the input comes from ``set_input_tensor`` (the pipeline
schedule's receive buffer). Full activation recompute (``uniform``: groups of
``recompute_num_layers``; ``block``: the first ``recompute_num_layers`` layers) is
:func:`megatron_core.recompute.checkpointed_forward`, which restores the RNG states so that dropout replays exactly.
Under sequence parallelism each rank holds different tokens, so the whole stack runs inside the
tracker's model-parallel RNG fork (the attention does not fork again then).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.dist_checkpointing.sharded_module import (
    sharded_state_dict_default,
    sharded_state_dict_for_layers,
)
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.transformer.causal_mask import drop_plain_causal_mask
from megatron_core.transformer.full_recompute import checkpointed_forward
from megatron_core.transformer.module import GraphableMegatronModule
from megatron_core.transformer.pipeline_layout import get_num_layers_to_build, get_transformer_layer_offset
from megatron_core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import BaseTransformerLayer, TransformerLayer

__all__ = ["TransformerBlock", "TransformerBlockSubmodules", "get_num_layers_to_build"]


@dataclass
class TransformerBlockSubmodules:
    """Per-layer specs (all ``num_layers`` or just this chunk's) and the final norm."""

    layer_specs: list[ModuleSpec] | None = None
    layer_norm: ModuleSpec | type | None = None


def _get_block_submodules(
    config: TransformerConfig, spec: TransformerBlockSubmodules | ModuleSpec, num_layers_to_build: int, offset: int
) -> TransformerBlockSubmodules:
    """Normalize the accepted spec forms into this chunk's layer specs."""
    if isinstance(spec, TransformerBlockSubmodules):
        submodules = spec
    elif isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        submodules = spec.submodules
    elif isinstance(spec, ModuleSpec) and issubclass(get_module(spec), BaseTransformerLayer):
        submodules = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=WrappedTorchNorm)
    else:
        raise TypeError(
            f"TransformerBlock spec must be TransformerBlockSubmodules or a ModuleSpec of a TransformerLayer, got {spec!r}"
        )
    layer_specs = list(submodules.layer_specs or [])
    if len(layer_specs) == config.num_layers:
        layer_specs = layer_specs[offset : offset + num_layers_to_build]
    elif len(layer_specs) != num_layers_to_build:
        raise ValueError(
            f"the block spec has {len(layer_specs)} layer specs; expected num_layers ({config.num_layers}) or this "
            f"pipeline chunk's {num_layers_to_build} layers"
        )
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=submodules.layer_norm)


class TransformerBlock(GraphableMegatronModule):
    """This pipeline chunk's transformer layers and, on the last stage, the final norm."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: TransformerBlockSubmodules | ModuleSpec,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: Any = None,
        vp_stage: int | None = None,
    ) -> None:
        super().__init__(config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.vp_stage = vp_stage
        self.input_tensor: torch.Tensor | None = None
        # This chunk's layers follow the pipeline group (pg_collection.pp, else parallel_state's).
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = self.pg_collection.tp
        pp_group = getattr(self.pg_collection, "pp", None)
        pp = dict(pp_rank=get_pg_rank(pp_group), pp_size=get_pg_size(pp_group))
        num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, **pp)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, **pp)
        self.submodules = _get_block_submodules(config, spec, num_layers, offset)
        self.layer_offset = offset
        self.layers = torch.nn.ModuleList(
            build_module(
                layer_spec, config=_layer_config(config, offset + i + 1), layer_number=i + 1,
                pg_collection=self.pg_collection, vp_stage=vp_stage,
            )
            for i, layer_spec in enumerate(self.submodules.layer_specs)
        )
        if post_layer_norm and self.submodules.layer_norm is not None and self._holds_final_norm(num_layers, offset):
            self.final_layernorm = build_module(
                self.submodules.layer_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )
        else:
            self.final_layernorm = None

    def _holds_final_norm(self, num_layers: int, offset: int) -> bool:
        """The final norm sits on the last stage; with standalone MTP stages (``config.mtp_standalone``) on the chunk
        of the last decoder layer, ahead of the MTP layers (Megatron-Core 0.19's rule there)."""
        if getattr(self.config, "mtp_standalone", False):
            return num_layers > 0 and offset + num_layers == self.config.num_layers
        return self.post_process

    @property
    def num_layers_per_pipeline_rank(self) -> int:
        """Number of layers this chunk holds."""
        return len(self.layers)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """Sharded state with this chunk's layers stacked on a global layer axis (``decoder.layers.*``).

        Layer ``i`` of this chunk is global layer ``layer_offset + i``; the checkpoint keys carry no
        local index, so a checkpoint reshards across pipeline layouts. Layers of different kinds (dense and MoE
        layers mixed by ``moe_layer_freq``, linear and softmax attention by ``linear_attention_freq``, heterogeneous
        layers, or ``metadata["non_homogeneous_layers"]``) are not stacked: each is saved under
        ``decoder.layers.<global index>.``, as Megatron-Core does.
        """
        layers_prefix = f"{prefix}layers."
        out = sharded_state_dict_for_layers(
            self.layers, layers_prefix, [self.layer_offset + i for i in range(len(self.layers))],
            self.config.num_layers, sharded_offsets, metadata, stacked=not _non_homogeneous_layers(self.config, metadata),
        )
        for name, child in self.named_children():
            if name != "layers":
                out.update(child.sharded_state_dict(prefix=f"{prefix}{name}.", sharded_offsets=sharded_offsets,
                                                    metadata=metadata) if hasattr(child, "sharded_state_dict")
                           else sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata,
                                                           tp_group=self.tp_group))
        return out

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """Use ``input_tensor`` (received from the previous stage) as the block input."""
        self.input_tensor = input_tensor

    def _get_layer(self, layer_number: int) -> TransformerLayer:
        return self.layers[layer_number]

    def _run_layers(self, start: int, end: int, hidden_states: torch.Tensor, **layer_kwargs: Any) -> torch.Tensor:
        for layer in self.layers[start:end]:
            hidden_states, _ = layer(hidden_states, **layer_kwargs)
        return hidden_states

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
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
    ) -> torch.Tensor:
        """Run this chunk's layers on ``[s, b, h]`` (or the pipeline input) and the final norm."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError(
                    "TransformerBlock has pre_process=False but no input tensor; call set_input_tensor() first"
                )
            hidden_states = self.input_tensor
        # The plain causal mask adds nothing to causal layers and would keep SDPA off its fused kernels.
        attention_mask = drop_plain_causal_mask(self, attention_mask)
        layer_kwargs = dict(
            attention_mask=attention_mask,
            context=context,
            context_mask=context_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if self.config.sequence_parallel and self.training
            else contextlib.nullcontext()
        )
        with rng:
            if self.config.recompute_granularity == "full" and self.training:
                hidden_states = checkpointed_forward(
                    self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb, attention_bias,
                    packed_seq_params, use_inner_quantization_context=False, rotary_pos_cos=rotary_pos_cos,
                    rotary_pos_sin=rotary_pos_sin, sequence_len_offset=sequence_len_offset,
                )
            else:
                hidden_states = self._run_layers(0, len(self.layers), hidden_states, **layer_kwargs)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        elif not self.pre_process and not self.layers:
            # An empty chunk: its output must not be the received tensor itself (the schedules free outputs).
            hidden_states = hidden_states.clone()
        return hidden_states


def _layer_config(config: TransformerConfig, layer_number: int) -> TransformerConfig:
    """The config global layer ``layer_number`` (1-based) is built with: its own one under
    ``heterogeneous_block_specs`` (``HeterogeneousTransformerConfig.get_config_for_layer``)."""
    if not config.heterogeneous_block_specs:
        return config
    if not hasattr(config, "get_config_for_layer"):
        raise ValueError(f"heterogeneous_block_specs=True needs a config with per-layer configs "
                         f"(HeterogeneousTransformerConfig), got a {type(config).__name__}")
    return config.get_config_for_layer(layer_number)


def _non_homogeneous_layers(config: TransformerConfig, metadata: dict | None) -> bool:
    """Whether the layers differ in kind, so that they cannot share stacked checkpoint keys (Megatron-Core's rule)."""
    metadata = metadata or {}
    if metadata.get("non_homogeneous_layers") or metadata.get("singleton_local_shards"):
        return True
    if config.heterogeneous_block_specs or config.hetereogenous_dist_checkpoint:
        return True
    return any(isinstance(freq, list) or (isinstance(freq, int) and freq > 1)
               for freq in (config.moe_layer_freq, config.linear_attention_freq))
