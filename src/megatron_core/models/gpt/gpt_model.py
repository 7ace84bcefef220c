"""The GPT decoder-only language model (Megatron-Core's ``GPTModel``).

``embedding`` (first pipeline stage) -> ``decoder`` (this stage's transformer layers) ->
``output_layer`` (last stage, column-parallel over the vocabulary). ``forward`` takes ``[b, s]``
ids and returns per-token loss ``[b, s]`` when ``labels`` are given, else logits ``[b, s, V/TP]``
(the full vocabulary when ``parallel_output=False``); a stage without the output layer returns
its hidden states ``[s, b, h]`` (a standalone MTP stage, ``config.mtp_standalone``: the decoder's and each MTP
depth's concatenated, ``[(1 + D) s, b, h]``, which the last stage splits for the losses). State-dict keys match Megatron-Core's GPTModel with the local spec.
``position_embedding_type="mrope"`` (multimodal RoPE, ``config.mrope_section``) takes ``position_ids`` ``[3, b, s]``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core._activation_offload.interface import start_model_chunk
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.config_rules import check_model_sizes as _check_model_sizes
from megatron_core.config_rules import check_sequence_fits as _check_sequence_fits
from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron_core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron_core.models.common.language_module.inference_logits import (
    inference_logit_hidden_states,
    inference_output_layer,
)
from megatron_core.models.common.language_module.language_module import (
    LanguageModule,
    check_position_embedding_type,
)
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.mtp_placement import get_mtp_embedding_ranks
from megatron_core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    mtp_on_this_rank,
    process_mtp_loss,
)
from megatron_core.transformer.packed_sequences import packed_cp_group
from megatron_core.transformer.rope_options import check_mrope_section
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["GPTModel"]

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "mrope", "yarn", "none")


class GPTModel(LanguageModule):
    """A GPT language model for one pipeline chunk (``pre_process``: has the embedding, ``post_process``: the head)."""

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec | TransformerBlockSubmodules,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        mtp_block_spec: ModuleSpec | None = None,
        pg_collection: Any = None,
        vp_stage: int | None = None,
        logit_dtype: torch.dtype | None = None,
    ) -> None:
        # Before the groups are read: a standalone MTP stage joins the embedding group.
        _include_mtp_stages_in_embedding_group(config, share_embeddings_and_output_weights, pg_collection)
        super().__init__(config, pg_collection=pg_collection)
        check_position_embedding_type(position_embedding_type, _POSITION_EMBEDDING_TYPES)
        _check_model_sizes(vocab_size, max_sequence_length)
        # Every part gets the same groups (self.pg_collection: the argument, else parallel_state's).
        self._check_vocab_split(vocab_size)
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.logit_dtype = logit_dtype
        self.disable_param_offloading = True  # offloading: parameters are marked to stay on the device at first

        self.mtp_block_spec = mtp_block_spec
        self.mtp_process = mtp_block_spec is not None and mtp_on_this_rank(
            layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
            ignore_virtual=False, vp_stage=vp_stage)
        if self.mtp_process and not post_process and not config.mtp_standalone:
            raise ValueError("the MTP layers are on a stage before the last (post_process=False) but "
                             "config.mtp_standalone is False: only a pipeline_model_parallel_layout that places them "
                             "there sets it (and with it the shape exchange the concatenated hidden states need)")
        if pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
                tp_group=self.tp_group,
            )
        if config.multi_latent_attention and position_embedding_type == "yarn":
            raise ValueError(
                "position_embedding_type='yarn' with multi_latent_attention=True: MLA applies its own rotary "
                "embedding (MLATransformerConfig.rope_type='yarn'); use position_embedding_type='rope'"
            )
        if position_embedding_type == "rope" and not config.multi_latent_attention:  # MLA rotates by itself
            self.rotary_pos_emb = self.build_rotary_embedding(
                rotary_percent, seq_len_interpolation_factor, rotary_base, rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor)
        elif position_embedding_type == "yarn":  # the config's yarn_* fields (Megatron-Core reads them likewise)
            self.rotary_pos_emb = YarnRotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                use_cpu_initialization=config.use_cpu_initialization,
                scaling_factor=config.yarn_rotary_scaling_factor,
                original_max_position_embeddings=config.yarn_original_max_position_embeddings,
                beta_fast=config.yarn_beta_fast,
                beta_slow=config.yarn_beta_slow,
                mscale=config.yarn_mscale,
                mscale_all_dim=config.yarn_mscale_all_dim,
                correction_range_round_to_int=config.yarn_correction_range_round_to_int,
                cp_group=self.pg_collection.cp,
            )
        elif position_embedding_type == "mrope":  # Qwen2-VL's multimodal RoPE from [3, b, s] position ids
            self.rotary_pos_emb = _multimodal_rotary_embedding(config, rotary_percent, seq_len_interpolation_factor,
                                                               rotary_base, self.pg_collection.cp)
            self.mrope_section = list(config.mrope_section)
        self.decoder = TransformerBlock(
            config=config,
            spec=transformer_layer_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
            vp_stage=vp_stage,
        )
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(config=config, spec=mtp_block_spec, vp_stage=vp_stage,
                                                 pg_collection=self.pg_collection)
        if post_process:
            # Tied: the stage's embedding weight (the first stage's, or the MTP stage's copy of it) is used.
            self.output_layer = self.build_output_layer(
                vocab_size, parallel_output,
                skip_weight_param_allocation=(pre_process or self.mtp_process) and share_embeddings_and_output_weights)
        if pre_process or post_process or self.mtp_process:
            self.setup_embeddings_and_output_layer()

    def preprocess_for_fine_grained_offloading(self) -> None:
        """Start this chunk's micro-batch in the activation offload manager; the first time, mark every parameter
        to stay on the device."""
        start_model_chunk(self, self.config, get_pg_rank(getattr(self.pg_collection, "pp", None)), self.vp_stage)

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Feed the previous pipeline stage's output into the decoder."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def _mrope_angles(self, position_ids: torch.Tensor | None, decoder_input: torch.Tensor | None,
                      packed_seq_params: Any, inference_context: Any) -> torch.Tensor:
        """Multimodal rotary angles ``[s, b, 1, rot_dim]`` for ``position_ids`` ``[3, b, s]`` (the whole sequence
        under context parallelism: this rank's chunks are taken from it), on the activations' device."""
        if packed_seq_params is not None or inference_context is not None:
            raise ValueError("position_embedding_type='mrope' supports neither packed sequences (packed_seq_params) "
                             "nor a KV-cache inference context: both index the angles by 1-D positions")
        if position_ids is None:
            raise ValueError("position_embedding_type='mrope' needs position_ids of shape [3, batch, seq] "
                             "(temporal, height, width), got None")
        hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
        angles = self.rotary_pos_emb(position_ids, self.mrope_section)
        seq = hidden.size(0) * (get_pg_size(self.tp_group) if self.config.sequence_parallel else 1)
        if tuple(angles.shape[:2]) != (seq, hidden.size(1)):
            cp = get_pg_size(self.pg_collection.cp)
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must be [3, batch, seq] for the whole sequence "
                             f"(batch {hidden.size(1)}, seq {seq} * context_parallel_size {cp} = {seq * cp})")
        return angles.to(hidden.device)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params: Any = None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss ``[b, s]`` with ``labels``; logits ``[b, s, V/TP]`` without; hidden ``[s, b, h]`` on a non-last stage."""
        inference_context = inference_context if inference_context is not None else inference_params
        if self.config.fine_grained_activation_offloading and torch.is_grad_enabled():
            self.preprocess_for_fine_grained_offloading()
        decoder_input, rotary_pos_emb, _, _, _, padding_mask = self._preprocess(
            input_ids, position_ids, decoder_input, inference_context, packed_seq_params, padding_mask)
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
            **(extra_block_kwargs or {}),
        )
        return self._postprocess(
            hidden_states, input_ids, position_ids, labels, rotary_pos_emb, None, None, mtp_in_postprocess=True,
            loss_mask=loss_mask, attention_mask=attention_mask, padding_mask=padding_mask,
            packed_seq_params=packed_seq_params, runtime_gather_output=runtime_gather_output,
            inference_context=inference_context)

    def _preprocess(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple:
        """The embedding (first stage) and the rotary angles before the decoder.

        Returns ``(decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset,
        padding_mask)`` as Megatron-Core does (the cos/sin and offset slots are None here).
        """
        if input_ids is not None and packed_seq_params is None and inference_context is None:
            _check_sequence_fits(input_ids.shape[-1], self.max_sequence_length)
        if packed_seq_params is not None and input_ids is not None:
            _validate_packed(packed_seq_params, input_ids, packed_cp_group(packed_seq_params, self.pg_collection.cp))
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if self.position_embedding_type in ("rope", "yarn") and not self.config.multi_latent_attention:
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(
                inference_context, self.decoder, decoder_input, self.config, packed_seq_params
            )
            rotary_pos_emb = self.rotary_pos_emb(
                seq_len, packed_seq=packed_seq_params is not None and packed_seq_params.qkv_format in (None, "thd")
            )
            if self.position_embedding_type == "yarn":  # (angles, factor): attention takes the factor from the config
                rotary_pos_emb = rotary_pos_emb[0]
            # The angles follow the activations (a CPU model on a machine whose current device is a GPU).
            hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
            if rotary_pos_emb.device != hidden.device:
                rotary_pos_emb = rotary_pos_emb.to(hidden.device)
        elif self.position_embedding_type == "mrope":
            rotary_pos_emb = self._mrope_angles(position_ids, decoder_input, packed_seq_params, inference_context)
        return decoder_input, rotary_pos_emb, None, None, None, padding_mask

    def _postprocess(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        rotary_pos_emb: torch.Tensor | None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        mtp_in_postprocess: bool | None = None,
        loss_mask: torch.Tensor | None = None,
        decoder_input: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        inference_params: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Any = None,
        runtime_gather_output: bool | None = None,
        extra_block_kwargs: dict | None = None,
        inference_context: Any = None,
    ) -> torch.Tensor:
        """After the decoder: the MTP depths (``mtp_in_postprocess``), then on the last stage the output layer and
        the loss ``[b, s]`` with ``labels`` (logits ``[b, s, V/TP]`` without); other stages return ``hidden_states``."""
        inference_context = inference_context if inference_context is not None else inference_params
        if mtp_in_postprocess and self.mtp_process and inference_context is None:  # MTP depths after the decoder's
            hidden_states = self.mtp(
                input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                attention_mask=attention_mask, padding_mask=padding_mask, rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params, embedding=self.embedding)
        if not self.post_process:
            return hidden_states
        # On the last stage after a standalone MTP stage the received states are already concatenated.
        mtp_states = self.mtp_process or self.config.mtp_standalone
        if self.config.mtp_num_layers and mtp_states and inference_context is None:
            hidden_states = process_mtp_loss(
                hidden_states=hidden_states, labels=labels, loss_mask=loss_mask, output_layer=self.output_layer,
                output_weight=(self.shared_embedding_or_output_weight()
                               if self.share_embeddings_and_output_weights else None),
                runtime_gather_output=runtime_gather_output, is_training=self.training,
                compute_language_model_loss=self.compute_language_model_loss, config=self.config,
                cp_group=self.pg_collection.cp, tp_group=self.tp_group, packed_seq_params=packed_seq_params,
                scale_logits_fn=self._scale_logits if self.config.use_mup else None, input_ids=input_ids)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if inference_context is not None:  # only the positions whose logits generation needs
            hidden_states = inference_logit_hidden_states(self.output_layer, hidden_states, inference_context,
                                                          self.tp_group)
            if getattr(inference_context, "keep_mtp_hidden_states", False):  # speculative decoding drafts from them
                inference_context.mtp_decoder_hidden_states = hidden_states
            logits, _ = inference_output_layer(self.output_layer, hidden_states, weight=output_weight,
                                               runtime_gather_output=runtime_gather_output)
        else:
            logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                          runtime_gather_output=runtime_gather_output)
        logits = self._scale_logits(logits)
        if labels is None:
            logits = logits.transpose(0, 1).contiguous()
            return logits if self.logit_dtype is None else logits.to(self.logit_dtype)
        return self.compute_language_model_loss(labels, logits)

    def build_schedule_plan(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        inference_params: Any = None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        output_processor: Any = None,
        output_processor_context: Any = None,
    ) -> Any:
        """The combined 1F1B schedule's plan for one micro-batch: the same arguments as :meth:`forward`, but
        nothing runs yet; returns a
        :class:`~megatron_core.models.common.model_chunk_schedule_plan.TransformerModelChunkSchedulePlan`.

        Multi-token-prediction depths on this chunk are scheduled as layers after the decoder's. Not supported in
        the plan (``ValueError``): inference, ``extra_block_kwargs`` and ``output_processor``.
        """
        unsupported = {"inference_context": inference_context if inference_context is not None else inference_params,
                       "extra_block_kwargs": extra_block_kwargs or None, "output_processor": output_processor,
                       "config.mtp_standalone": self.config.mtp_standalone or None}
        given = [name for name, value in unsupported.items() if value is not None]
        if given:
            raise ValueError(f"build_schedule_plan (overlap_moe_expert_parallel_comm) does not support {given}")
        if self.config.fine_grained_activation_offloading:
            self.preprocess_for_fine_grained_offloading()
        # Imported here: models.common's plan builds on this package's layers.
        from megatron_core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

        return TransformerModelChunkSchedulePlan(
            self, input_ids, position_ids, attention_mask, decoder_input, labels, packed_seq_params, None,
            runtime_gather_output, loss_mask, padding_mask)


def _include_mtp_stages_in_embedding_group(config: TransformerConfig, share_embeddings_and_output_weights: bool,
                                           pg_collection: Any) -> None:
    """With standalone MTP stages, make ``parallel_state``'s embedding groups the stages that hold a word-embedding
    copy (first, MTP, and last when tied; ``get_mtp_embedding_ranks``).

    Collective the first time on every rank (each builds its first model chunk), a no-op once the groups are right
    (or were given so to ``initialize_model_parallel``). A ``pg_collection`` that carries ``parallel_state``'s
    embedding group (``get_model`` passes such a one) gets the new group; one with its own group is left alone.
    """
    if not config.mtp_standalone or not parallel_state.model_parallel_is_initialized():
        return
    current = parallel_state.get_embedding_group(check_initialized=False)
    if pg_collection is not None and getattr(pg_collection, "embd", None) is not current:
        return
    rule = partial(get_mtp_embedding_ranks, config=config,
                   share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    if parallel_state.set_embedding_ranks(rule) and pg_collection is not None:
        pg_collection.embd = parallel_state.get_embedding_group(check_initialized=False)


def _multimodal_rotary_embedding(config: TransformerConfig, rotary_percent: float,
                                 seq_len_interpolation_factor: float | None, rotary_base: int,
                                 cp_group: Any) -> MultimodalRotaryEmbedding:
    """The ``MultimodalRotaryEmbedding`` of ``position_embedding_type="mrope"``, after checking ``mrope_section``."""
    if config.multi_latent_attention:
        raise ValueError("position_embedding_type='mrope' with multi_latent_attention=True: MLA applies its own "
                         "rotary embedding from 1-D positions; use position_embedding_type='rope'")
    if config.mrope_section is None:
        raise ValueError("position_embedding_type='mrope' needs TransformerConfig.mrope_section (the temporal, height "
                         "and width sections of the rotary frequencies), got None")
    embedding = MultimodalRotaryEmbedding(
        kv_channels=config.kv_channels, rotary_percent=rotary_percent, rotary_interleaved=config.rotary_interleaved,
        seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base, cp_group=cp_group)
    check_mrope_section(config.mrope_section, embedding.inv_freq.numel())
    return embedding


def _validate_packed(params: Any, input_ids: torch.Tensor, cp_group: Any) -> None:
    """Check ``cu_seqlens`` against the packed token count before any compute (cached per params object)."""
    from megatron_core.transformer.packed_sequences import thd_layout

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"packed sequences (qkv_format='thd') need input_ids of shape [1, t], got {tuple(input_ids.shape)}"
        )
    thd_layout(params, input_ids.shape[1] * get_pg_size(cp_group))
