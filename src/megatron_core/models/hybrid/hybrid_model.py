"""The hybrid language model (Megatron-Core's ``models.hybrid.hybrid_model.HybridModel``).

``embedding`` -> ``decoder`` (:class:`~megatron_core.models.hybrid.hybrid_block.HybridStack` built from this pipeline
segment of ``hybrid_layer_pattern``) -> ``output_layer``. ``forward`` takes ``[b, s]`` ids and returns
per-token loss ``[b, s]`` with ``labels``, else logits ``[b, s, V/TP]``; a non-last stage returns hidden
states ``[s, b, h]``. Under the dynamic inference context (``inference_context``) the attention layers use the
paged KV cache and the Mamba layers their per-request state slots, and only the rows the step samples from get
logits.

Multi-token prediction comes from the pattern: ``"M*M-/*M/*M"`` is the decoder ``"M*M-"`` and two MTP depths of
``"*M"`` (``config.mtp_num_layers`` must be 2). The last stage builds ``mtp``
(:class:`~megatron_core.transformer.multi_token_prediction.MultiTokenPredictionBlock` from the stack spec's
``mtp_block_spec`` and its layer specs) and a copy of the embedding, and training attaches the MTP losses to the
main loss through ``process_mtp_loss``, as GPTModel does. Inference skips the MTP depths.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_core._activation_offload.interface import start_model_chunk
from megatron_core._ground import get_pg_rank
from megatron_core._ground.hybrid_pattern import (
    get_hybrid_total_layer_count,
    parse_hybrid_pattern,
    pattern_from_ratios,
    select_pipeline_segment,
)
from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.models.common.language_module.inference_logits import (
    inference_logit_hidden_states,
    inference_output_layer,
)
from megatron_core.models.common.language_module.language_module import LanguageModule
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.module import GraphableMegatronModule
from megatron_core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    mtp_on_this_rank,
    process_mtp_loss,
)
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["HybridModel"]

logger = logging.getLogger(__name__)
_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


def _resolve_pattern(config: TransformerConfig, pattern: str | None, attention_ratio: float | None,
                     mlp_ratio: float | None, override_pattern: str | None) -> str:
    """The hybrid pattern from the current argument or the deprecated ones (Megatron-Core's precedence)."""
    if override_pattern is not None:
        if pattern is not None:
            raise ValueError(f"hybrid_override_pattern ({override_pattern!r}) and hybrid_layer_pattern "
                             f"({pattern!r}) cannot both be set; hybrid_override_pattern is deprecated")
        pattern = override_pattern
    if (attention_ratio or 0.0) > 0.0 or (mlp_ratio or 0.0) > 0.0:
        if pattern is not None:
            raise ValueError(f"hybrid_layer_pattern ({pattern!r}) cannot be combined with the deprecated "
                             f"hybrid_attention_ratio ({attention_ratio}) / hybrid_mlp_ratio ({mlp_ratio})")
        pattern = pattern_from_ratios(config.num_layers, attention_ratio or 0.0, mlp_ratio or 0.0)
    if pattern is None:
        pattern = "M" * config.num_layers
    return pattern


def _check_mtp_depths(config: TransformerConfig, pattern: str, mtp_num_depths: int) -> None:
    """The pattern's MTP depths (``/`` parts) and ``config.mtp_num_layers`` must agree (Megatron-LM's arguments
    derive the latter from the former)."""
    if mtp_num_depths and config.mtp_num_layers != mtp_num_depths:
        raise ValueError(f"hybrid_layer_pattern {pattern!r} has {mtp_num_depths} MTP depths but config.mtp_num_layers "
                         f"is {config.mtp_num_layers}; set mtp_num_layers={mtp_num_depths}")
    if config.mtp_num_layers and not mtp_num_depths:
        raise ValueError(f"config.mtp_num_layers is {config.mtp_num_layers} but hybrid_layer_pattern {pattern!r} has "
                         "no MTP depths; a hybrid model's MTP layers come from the pattern: append one '/<pattern>' "
                         "per depth (e.g. 'M*M*/MM/MM')")


class HybridModel(LanguageModule, GraphableMegatronModule):
    """A hybrid Mamba / attention / MLP language model for one pipeline chunk.

    ``hybrid_stack_spec`` is usually :data:`~megatron_core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec`. ``hybrid_layer_pattern``
    must have ``config.num_layers`` layer symbols (``|`` marks pipeline segments); without a pattern every
    layer is a Mamba layer.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hybrid_stack_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        hybrid_layer_pattern: str | None = None,
        hybrid_attention_ratio: float | None = None,
        hybrid_mlp_ratio: float | None = None,
        hybrid_override_pattern: str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        pg_collection: Any = None,
        vp_stage: int | None = None,
    ) -> None:
        super().__init__(config, pg_collection=pg_collection)
        for arg_name, value in (("hybrid_stack_spec", hybrid_stack_spec), ("vocab_size", vocab_size),
                                ("max_sequence_length", max_sequence_length)):
            if value is None:
                raise ValueError(f"{type(self).__name__} needs {arg_name}")
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type ({position_embedding_type!r}) must be one of "
                             f"{list(_POSITION_EMBEDDING_TYPES)}")
        self._check_vocab_split(vocab_size)
        pattern = _resolve_pattern(config, hybrid_layer_pattern, hybrid_attention_ratio, hybrid_mlp_ratio,
                                   hybrid_override_pattern)
        parsed = parse_hybrid_pattern(pattern)
        _check_mtp_depths(config, pattern, parsed.mtp_num_depths)
        total = get_hybrid_total_layer_count(pattern)
        if total != config.num_layers:
            raise ValueError(f"hybrid_layer_pattern {pattern!r} has {total} layers but config.num_layers is "
                             f"{config.num_layers}; they must match")
        self.hybrid_stack_spec = hybrid_stack_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.hybrid_layer_pattern = pattern
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy, self.parallel_output = fp16_lm_cross_entropy, parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type, self.vp_stage = position_embedding_type, vp_stage
        self.mtp_pattern, self.mtp_num_depths = parsed.mtp_pattern, parsed.mtp_num_depths
        self.mtp_process = bool(self.mtp_num_depths) and mtp_on_this_rank(
            layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers, ignore_virtual=False,
            vp_stage=vp_stage)
        if self.mtp_process and not post_process:
            raise ValueError("the MTP depths of a hybrid model run on the stage that computes the loss "
                             "(post_process=True); this stage holds them but has post_process=False")
        self.model_type = ModelType.encoder_or_decoder
        layer_type_list, layer_offset = select_pipeline_segment(
            parsed.main_pattern or "", getattr(self.pg_collection, "pp", None), vp_stage,
            first_stage_layers=config.num_layers_in_first_pipeline_stage,
            last_stage_layers=config.num_layers_in_last_pipeline_stage,
        )
        if pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel, tp_group=self.tp_group,
            )
        if position_embedding_type == "rope":
            # As Megatron-Core's hybrid model: the rotation is never interleaved here.
            self.rotary_pos_emb = self.build_rotary_embedding(rotary_percent, seq_len_interpolation_factor,
                                                              rotary_base, rotary_interleaved=False)
        self.decoder = build_module(
            hybrid_stack_spec, config, pre_process=pre_process, layer_type_list=layer_type_list,
            pp_layer_offset=layer_offset, post_process=post_process, dtype=config.params_dtype,
            pg_collection=self.pg_collection, name="decoder",
        )
        if self.mtp_process:
            mtp_block_spec = getattr(hybrid_stack_spec.submodules, "mtp_block_spec", None)
            if mtp_block_spec is None:
                raise ValueError(f"hybrid_layer_pattern {pattern!r} has MTP depths but hybrid_stack_spec.submodules."
                                 "mtp_block_spec is None; use a stack spec with an MTP block spec (hybrid_stack_spec)")
            self.mtp = MultiTokenPredictionBlock(
                config=config, spec=mtp_block_spec, vp_stage=vp_stage, pg_collection=self.pg_collection,
                mtp_layer_pattern=self.mtp_pattern, mtp_num_depths=self.mtp_num_depths,
                hybrid_submodules=hybrid_stack_spec.submodules, name="mtp")
        if post_process:
            # Tied: the stage's embedding weight (the first stage's, or the MTP stage's copy of it) is used.
            self.output_layer = self.build_output_layer(
                vocab_size, parallel_output,
                skip_weight_param_allocation=(pre_process or self.mtp_process) and share_embeddings_and_output_weights)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Feed the previous pipeline stage's output into the decoder."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"HybridModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def preprocess_for_fine_grained_offloading(self) -> None:
        """Start this chunk's micro-batch in the activation offload manager; the first time, mark every parameter
        to stay on the device."""
        start_model_chunk(self, self.config, get_pg_rank(getattr(self.pg_collection, "pp", None)), self.vp_stage)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None, decoder_input: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inference_context: Any = None,
                runtime_gather_output: bool | None = None, *, inference_params: Any = None,
                loss_mask: torch.Tensor | None = None, packed_seq_params: Any = None,
                padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Loss ``[b, s]`` with ``labels``; logits ``[b, s, V/TP]`` without; hidden ``[s, b, h]`` on a non-last stage."""
        inference_context = inference_context if inference_context is not None else inference_params
        if self.config.fine_grained_activation_offloading and torch.is_grad_enabled():
            self.preprocess_for_fine_grained_offloading()
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(inference_context, self.decoder, decoder_input,
                                                             self.config, packed_seq_params)
            rotary_pos_emb = self.rotary_pos_emb(seq_len)
            hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
            rotary_pos_emb = rotary_pos_emb.to(hidden.device)
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                                     packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if self.mtp_process and inference_context is None:  # MTP depths after the decoder's (concatenated)
            hidden_states = self.mtp(
                input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                attention_mask=attention_mask, padding_mask=padding_mask, rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params, embedding=self.embedding)
            hidden_states = process_mtp_loss(
                hidden_states=hidden_states, labels=labels, loss_mask=loss_mask, output_layer=self.output_layer,
                output_weight=output_weight, runtime_gather_output=runtime_gather_output, is_training=self.training,
                compute_language_model_loss=self.compute_language_model_loss, config=self.config,
                cp_group=self.pg_collection.cp, tp_group=self.tp_group, packed_seq_params=packed_seq_params,
                scale_logits_fn=self._scale_logits if self.config.use_mup else None, input_ids=input_ids)
        if not self.post_process:
            return hidden_states
        if inference_context is not None:  # only the positions whose logits generation needs
            hidden_states = inference_logit_hidden_states(self.output_layer, hidden_states, inference_context,
                                                          self.tp_group)
            logits, _ = inference_output_layer(self.output_layer, hidden_states, weight=output_weight,
                                               runtime_gather_output=runtime_gather_output)
        else:
            logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                          runtime_gather_output=runtime_gather_output)
        logits = self._scale_logits(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)
