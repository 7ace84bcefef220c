"""The T5 encoder-decoder language model (Megatron-Core's ``T5Model`` and ``T5LMHead``).

``embedding`` (shared by encoder and decoder) -> ``encoder`` -> ``decoder`` (self-attention, then
cross-attention over the encoder's output) -> ``lm_head``. Ids are ``[b, s]``; the masks are Megatron's
boolean masks (True = masked): ``encoder_attn_mask`` ``[b, 1, se, se]``, ``decoder_attn_mask``
``[b, 1, sd, sd]`` and ``encoder_decoder_attn_mask`` ``[b, 1, sd, se]`` (see
:func:`t5_extended_attention_mask`). ``forward`` returns the per-token loss ``[b, sd]`` with
``lm_labels``, else logits ``[b, sd, V/TP]``. Positions are learned, rotary or T5's relative buckets
(a per-head bias, split over the tensor-parallel ranks by heads).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core.config_rules import check_sequence_fits
from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding
from megatron_core.models.common.language_module.language_module import (
    LanguageModule,
    check_position_embedding_type,
    output_layer_init_method,
)
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["T5LMHead", "T5Model", "t5_extended_attention_mask", "t5_position_ids"]

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "relative")


class T5LMHead(MegatronModule):
    """The vocabulary projection of the decoder output: ``output_layer`` (column-parallel).

    With tied embeddings the projection uses the word-embedding weight (passed to ``forward``) and has a bias of its
    own (``output_layer.bias``); untied, it has its own weight and no bias.
    """

    def __init__(
        self,
        config: TransformerConfig,
        parallel_output: bool,
        vocab_size: int,
        pre_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
        tp_group: Any = None,
    ) -> None:
        super().__init__(config)
        self.parallel_output = parallel_output
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=output_layer_init_method(config, share_embeddings_and_output_weights),
            bias=share_embeddings_and_output_weights,
            skip_bias_add=not share_embeddings_and_output_weights,
            gather_output=not parallel_output,
            skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor, word_embeddings_weight: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[s, b, V/TP]`` (``[s, b, V]`` without ``parallel_output``) from ``hidden_states`` ``[s, b, h]``."""
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits


class T5Model(LanguageModule):
    """A T5 encoder-decoder model for one pipeline stage (``add_encoder`` / ``add_decoder`` say which halves it holds).

    ``config`` builds the embedding, decoder and head, ``encoder_config`` the encoder. ``position_embedding_type``
    is ``'learned_absolute'``, ``'rope'`` or ``'relative'`` (``relative_attention_num_buckets`` and
    ``relative_attention_max_distance`` then shape the buckets; encoder buckets are bidirectional, decoder ones
    causal).
    """

    def __init__(
        self,
        config: TransformerConfig,
        encoder_config: TransformerConfig,
        transformer_encoder_layer_spec: ModuleSpec | TransformerBlockSubmodules,
        transformer_decoder_layer_spec: ModuleSpec | TransformerBlockSubmodules,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: float | None = None,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        add_encoder: bool = True,
        add_decoder: bool = True,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config, pg_collection=pg_collection)
        _check_arguments(vocab_size, max_sequence_length, position_embedding_type, add_encoder, add_decoder)
        self._check_vocab_split(vocab_size)
        self.config = config
        self.encoder_config = encoder_config
        self.transformer_encoder_layer_spec = transformer_encoder_layer_spec
        self.transformer_decoder_layer_spec = transformer_decoder_layer_spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_encoder = add_encoder
        self.add_decoder = add_decoder
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.encoder_hidden_state: torch.Tensor | None = None
        self.model_type = ModelType.encoder_or_decoder
        # The pipeline schedule keeps the encoder's output for the decoder's cross-attention.
        self.xattn_needed = True

        self.position_embeddings = None
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type, tp_group=self.tp_group,
            )
            if position_embedding_type == "learned_absolute":
                self.position_embeddings = self.embedding.position_embeddings
        if position_embedding_type == "rope":
            self.rotary_pos_emb = self.build_rotary_embedding(rotary_percent, seq_len_interpolation_factor)
        if position_embedding_type == "relative":
            relative = dict(init_method=config.init_method, num_attention_heads=config.num_attention_heads,
                            relative_attention_num_buckets=relative_attention_num_buckets,
                            relative_attention_max_distance=relative_attention_max_distance)
            self.encoder_relative_pos_emb = RelativePositionEmbedding(bidirectional=True, **relative)
            self.decoder_relative_pos_emb = RelativePositionEmbedding(bidirectional=False, **relative)

        block = dict(pre_process=pre_process, post_process=post_process, pg_collection=self.pg_collection)
        self.encoder = (TransformerBlock(config=encoder_config, spec=transformer_encoder_layer_spec, **block)
                        if add_encoder else None)
        self.decoder = (TransformerBlock(config=config, spec=transformer_decoder_layer_spec, **block)
                        if add_decoder else None)
        if post_process:
            self.lm_head = T5LMHead(config, parallel_output, vocab_size, pre_process,
                                    share_embeddings_and_output_weights, tp_group=self.tp_group)
            self.output_layer = self.lm_head.output_layer
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def forward(
        self,
        encoder_input_ids: torch.Tensor | None,
        decoder_input_ids: torch.Tensor | None,
        encoder_attn_mask: torch.Tensor | None,
        decoder_attn_mask: torch.Tensor | None,
        encoder_decoder_attn_mask: torch.Tensor | None,
        lm_labels: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        output_encoder_hidden_only: bool = False,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        *,
        inference_params: Any = None,
    ) -> torch.Tensor:
        """Loss ``[b, sd]`` with ``lm_labels``, else logits ``[b, sd, V/TP]``; hidden states ``[s, b, h]`` on a
        stage without the head, or the encoder's output with ``output_encoder_hidden_only``.

        ``encoder_hidden_states`` ``[se, b, h]`` skips the encoder (e.g. when decoding step by step).
        """
        inference_context = inference_context if inference_context is not None else inference_params
        if packed_seq_params is not None:
            raise ValueError("T5Model does not support packed sequences (packed_seq_params must be None)")
        _check_inputs(encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                      encoder_decoder_attn_mask, lm_labels, self.max_sequence_length, self.position_embedding_type,
                      inference_context)
        if encoder_hidden_states is None:
            encoder_hidden_states = self._encode(encoder_input_ids, encoder_attn_mask, inference_context)
        if not self.add_decoder or output_encoder_hidden_only:
            return encoder_hidden_states

        decoder_input = None
        if self.pre_process:
            decoder_input = self.embedding(input_ids=decoder_input_ids,
                                           position_ids=t5_position_ids(decoder_input_ids))
        rotary_pos_emb, attention_bias = self._positions(self.decoder, decoder_input, inference_context,
                                                         "decoder_relative_pos_emb")
        decoder_hidden_states = self.decoder(
            hidden_states=decoder_input, attention_mask=decoder_attn_mask, context=encoder_hidden_states,
            context_mask=encoder_decoder_attn_mask, inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
        )
        if not self.post_process:
            return decoder_hidden_states
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits = self.lm_head(decoder_hidden_states, word_embeddings_weight=output_weight)
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(lm_labels, logits)

    def _encode(self, encoder_input_ids: torch.Tensor | None, encoder_attn_mask: torch.Tensor | None,
                inference_context: Any) -> torch.Tensor | None:
        """The encoder's output ``[se, b, h]`` (on a decoder-only stage: the one received by ``set_input_tensor``)."""
        if not self.add_encoder:
            return self.encoder_hidden_state
        encoder_input = None
        if self.pre_process:
            encoder_input = self.embedding(input_ids=encoder_input_ids,
                                           position_ids=t5_position_ids(encoder_input_ids))
        rotary_pos_emb, attention_bias = self._positions(self.encoder, encoder_input, inference_context,
                                                         "encoder_relative_pos_emb")
        return self.encoder(hidden_states=encoder_input, attention_mask=encoder_attn_mask,
                            inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                            attention_bias=attention_bias)

    def _positions(self, block: TransformerBlock, block_input: torch.Tensor | None, inference_context: Any,
                   relative_name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(rotary angles, relative-position bias of this rank's heads)`` for one of the two blocks."""
        if self.position_embedding_type == "rope":
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(inference_context, block, block_input, self.config)
            return self.rotary_pos_emb(seq_len), None
        if self.position_embedding_type == "relative":
            seq_len = RelativePositionEmbedding.get_relative_seq_len(inference_context, block, block_input,
                                                                     self.config)
            bias = getattr(self, relative_name)(seq_len, seq_len)  # [1, heads, s, s]
            # This rank's heads: split the head dimension (moved last for the split, then back).
            local = tensor_parallel.scatter_to_tensor_model_parallel_region(bias.permute(0, 2, 3, 1), self.tp_group)
            return None, local.permute(0, 3, 1, 2)
        return None, None

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor | None] | None) -> None:
        """Take the previous pipeline stage's output(s): the encoder's input, or on a decoder-only stage the decoder's
        input and the encoder's output (one tensor: the encoder's output, the decoder starts here)."""
        tensors = list(input_tensor) if isinstance(input_tensor, (list, tuple)) else [input_tensor]
        if self.add_encoder:
            if len(tensors) != 1:
                raise ValueError(f"T5Model.set_input_tensor: a stage with the encoder takes 1 tensor, got "
                                 f"{len(tensors)}")
            self.encoder.set_input_tensor(tensors[0])
        elif len(tensors) == 2:
            self.decoder.set_input_tensor(tensors[0])
            self.encoder_hidden_state = tensors[1]
        elif len(tensors) == 1:
            self.decoder.set_input_tensor(None)
            self.encoder_hidden_state = tensors[0]
        else:
            raise ValueError(f"T5Model.set_input_tensor: a decoder stage takes 1 or 2 tensors, got {len(tensors)}")

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The sharded state as Megatron-Core's T5 saves it: the head is listed twice (``lm_head.output_layer.`` and
        ``output_layer.``), each with its ``_extra_state`` (only GPT's checkpoints drop ``output_layer``'s)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        head_extra = sharded.get(f"{prefix}lm_head.output_layer._extra_state")
        if head_extra is not None:
            key = f"{prefix}output_layer._extra_state"
            sharded[key] = replace(head_extra, key=key)
        return sharded

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word-embedding weight on a stage with the embedding, else the head's weight on the last stage."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.lm_head.output_layer.weight
        return None


def t5_extended_attention_mask(attention_mask_list: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each ``[b, sq, sk]`` mask as ``[b, 1, sq, sk]`` (broadcast over heads); ``None`` stays ``None``."""
    return [mask.unsqueeze(1) if mask is not None else None for mask in attention_mask_list]


def t5_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """Positions ``0 .. s-1`` for every row of ``token_ids`` ``[b, s]``."""
    positions = torch.arange(token_ids.size(1), dtype=torch.long, device=token_ids.device)
    return positions.unsqueeze(0).expand_as(token_ids)


def _check_arguments(vocab_size: Any, max_sequence_length: Any, position_embedding_type: str, add_encoder: bool,
                     add_decoder: bool) -> None:
    for name, value in (("vocab_size", vocab_size), ("max_sequence_length", max_sequence_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"T5Model: {name} ({value!r}) must be a positive int")
    check_position_embedding_type(position_embedding_type, _POSITION_EMBEDDING_TYPES, "T5Model: ")
    if not (add_encoder or add_decoder):
        raise ValueError("T5Model: add_encoder and add_decoder are both False; a stage needs at least one of them")


def _check_inputs(encoder_ids: torch.Tensor | None, decoder_ids: torch.Tensor | None, encoder_mask: Any,
                  decoder_mask: Any, cross_mask: Any, labels: torch.Tensor | None, max_sequence_length: int,
                  position_embedding_type: str, inference_context: Any) -> None:
    """ValueError naming the shapes when the ids, masks or labels do not fit together."""
    for name, ids in (("encoder_input_ids", encoder_ids), ("decoder_input_ids", decoder_ids)):
        if ids is None:
            continue
        if ids.dim() != 2:
            raise ValueError(f"T5Model: {name} must be [b, s], got shape {tuple(ids.shape)}")
        if position_embedding_type == "learned_absolute" and inference_context is None:
            check_sequence_fits(ids.shape[1], max_sequence_length)
    if encoder_ids is None or decoder_ids is None:
        return
    b, se, sd = encoder_ids.shape[0], encoder_ids.shape[1], decoder_ids.shape[1]
    if decoder_ids.shape[0] != b:
        raise ValueError(f"T5Model: encoder_input_ids {tuple(encoder_ids.shape)} and decoder_input_ids "
                         f"{tuple(decoder_ids.shape)} have different batch sizes")
    expected = {"encoder_attn_mask": (encoder_mask, se, se), "decoder_attn_mask": (decoder_mask, sd, sd),
                "encoder_decoder_attn_mask": (cross_mask, sd, se)}
    for name, (mask, sq, sk) in expected.items():
        if mask is None:
            continue
        if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[2] not in (1, sq) or mask.shape[3] != sk:
            raise ValueError(f"T5Model: {name} has shape {tuple(mask.shape)}; expected [b, 1, sq, sk] = "
                             f"[{b}, 1, {sq}, {sk}] (see t5_extended_attention_mask)")
    if labels is not None and tuple(labels.shape) != (b, sd):
        raise ValueError(f"T5Model: lm_labels has shape {tuple(labels.shape)}; expected [b, sd] = [{b}, {sd}] like "
                         "decoder_input_ids")
