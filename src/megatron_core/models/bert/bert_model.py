"""The BERT encoder language model (Megatron-Core's ``models.bert.bert_model.BertModel``).

``embedding`` (words + learned positions + optional token types) -> ``encoder`` (a pre-norm
``TransformerBlock`` with padding-masked self-attention and a final norm) -> ``lm_head`` (dense, GeLU,
norm) -> ``output_layer`` (column-parallel over the vocabulary, with a bias; its weight is the word
embedding when ``share_embeddings_and_output_weights``). With ``add_binary_head`` the ``pooler`` (dense
+ tanh on the first token) feeds ``binary_head``, a 2-way (next-sentence) classifier.

``forward(input_ids [b, s], attention_mask [b, s] (1 = real token, 0 = padding), tokentype_ids,
lm_labels)`` returns ``(per-token loss [b, s], binary_logits [b, 2])`` with ``lm_labels``, else
``(logits [b, s, V/TP], binary_logits)`` (``binary_logits`` is None without the binary head). A stage
without the head returns its hidden states ``[s, b, h]``; ``return_embeddings`` returns one ``[b, h]``
sentence embedding per sample instead. State-dict keys match Megatron-Core's BertModel.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._version_utils import is_te_min_version
from megatron_core.config_rules import check_sequence_fits, check_value
from megatron_core.device import get_current_device
from megatron_core.models.bert.bert_lm_head import BertLMHead
from megatron_core.models.bert.pooler import Pooler
from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.models.common.language_module.language_module import (
    LanguageModule,
    check_position_embedding_type,
)
from megatron_core.transformer.attention import SelfAttentionSubmodules
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnBackend, AttnMaskType, ModelType
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_block import TransformerBlock
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayerSubmodules
from megatron_core.transformer.utils import get_linear_layer

__all__ = ["BertModel"]

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")


class BertModel(LanguageModule):
    """A BERT model for one pipeline chunk (``pre_process``: has the embedding, ``post_process``: the heads)."""

    def __init__(
        self,
        config: TransformerConfig,
        num_tokentypes: int,
        transformer_layer_spec: ModuleSpec,
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
        add_binary_head: bool = True,
        return_embeddings: bool = False,
        vp_stage: int | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        check_position_embedding_type(position_embedding_type, _POSITION_EMBEDDING_TYPES, "BertModel ")
        check_value("BertModel", "vocab_size", vocab_size, "positive int")
        check_value("BertModel", "max_sequence_length", max_sequence_length, "positive int")
        if isinstance(num_tokentypes, bool) or not isinstance(num_tokentypes, int) or num_tokentypes < 0:
            raise ValueError(f"BertModel num_tokentypes ({num_tokentypes!r}) must be an int >= 0")
        if return_embeddings and not (post_process and add_binary_head):
            raise ValueError(f"BertModel return_embeddings=True needs post_process=True and add_binary_head=True, "
                             f"got post_process={post_process}, add_binary_head={add_binary_head}")
        self._check_vocab_split(vocab_size)

        self.transformer_layer_spec = transformer_layer_spec
        self.num_tokentypes = num_tokentypes
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.add_binary_head = add_binary_head
        self.return_embeddings = return_embeddings
        self.vp_stage = vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.attn_mask_dimensions = self._sanity_check_attention_and_get_attn_mask_dimension()

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type,
                num_tokentypes=num_tokentypes,
                tp_group=self.tp_group,
            )
        if position_embedding_type == "rope":
            self.rotary_pos_emb = self.build_rotary_embedding(rotary_percent, seq_len_interpolation_factor)
        self.encoder = TransformerBlock(
            config=config,
            spec=transformer_layer_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
            vp_stage=vp_stage,
        )
        if post_process:
            self.lm_head = BertLMHead(config.hidden_size, config)
            self.output_layer = self.build_output_layer(
                vocab_size, parallel_output, bias=True,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights)
            self.binary_head = None
            if add_binary_head:
                self.binary_head = get_linear_layer(
                    config.hidden_size, 2, config.init_method, config.perform_initialization
                )
                device = torch.device("cpu") if config.use_cpu_initialization else get_current_device()
                self.binary_head.to(device=device, dtype=config.params_dtype)
                self.pooler = Pooler(config.hidden_size, config.init_method, config, config.sequence_parallel,
                                     tp_group=self.tp_group)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        """Check the spec against ``config.attention_backend`` and pick the mask layout the core attention takes.

        ``"b1ss"`` (``[b, 1, s, s]``, a padded query also masks every key) for the local ``DotProductAttention``
        and for Transformer Engine before 1.7 (or 1.7-1.9 with the unfused backend, whose mask type becomes
        ``arbitrary``); ``"b11s"`` (``[b, 1, 1, s]``, keys only) for Transformer Engine 1.7-1.9 with the flash,
        fused or auto backend and for 1.10 and later, where the mask type is set to ``padding``.
        """
        layer = self.transformer_layer_spec.submodules
        if not isinstance(layer, TransformerLayerSubmodules):
            raise ValueError(f"BertModel transformer_layer_spec.submodules must be TransformerLayerSubmodules, "
                             f"got {type(layer).__name__}")
        attention = layer.self_attention
        if not isinstance(getattr(attention, "submodules", None), SelfAttentionSubmodules):
            raise ValueError("BertModel transformer_layer_spec.submodules.self_attention must be a ModuleSpec whose "
                             "submodules are SelfAttentionSubmodules")
        backend = self.config.attention_backend
        core = attention.submodules.core_attention
        if isinstance(core, type) and issubclass(core, DotProductAttention):
            if backend not in (AttnBackend.local, AttnBackend.auto):
                raise ValueError(f"attention_backend ({backend.name}) must be local or auto with the local "
                                 f"DotProductAttention in the BERT layer spec")
            return "b1ss"
        mask_type = attention.params.get("attn_mask_type")
        if is_te_min_version("1.10.0"):
            _set_mask_type(attention, mask_type, AttnMaskType.padding, "Transformer Engine >= 1.10")
            return "b11s"
        if is_te_min_version("1.7.0"):
            if backend in (AttnBackend.flash, AttnBackend.fused, AttnBackend.auto):
                return "b11s"
            _set_mask_type(attention, mask_type, AttnMaskType.arbitrary, "the unfused path of Transformer Engine "
                           "1.7-1.9")
            return "b1ss"
        if backend in (AttnBackend.flash, AttnBackend.fused):
            raise ValueError(f"attention_backend ({backend.name}) needs Transformer Engine >= 1.7 with the BERT "
                             f"Transformer Engine spec; use unfused or auto")
        return "b1ss"

    def bert_extended_attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` (1 = attend) -> boolean ``[b, 1, s, s]`` or ``[b, 1, 1, s]`` with True = masked."""
        if self.attn_mask_dimensions == "b1ss":
            extended = (attention_mask.unsqueeze(1) * attention_mask.unsqueeze(2)).unsqueeze(1)
        else:
            extended = attention_mask.unsqueeze(1).unsqueeze(1)
        return extended < 0.5

    def bert_position_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Positions ``0 .. s-1`` for every sample, ``[b, s]``."""
        positions = torch.arange(token_ids.size(1), dtype=torch.long, device=token_ids.device)
        return positions.unsqueeze(0).expand_as(token_ids)

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Feed the previous pipeline stage's output into the encoder."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"BertModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.encoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        tokentype_ids: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
        inference_context: Any = None,
        *,
        inference_params: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """``(loss [b, s], binary_logits)`` with ``lm_labels``, else ``(logits [b, s, V/TP], binary_logits)``."""
        inference_context = inference_context if inference_context is not None else inference_params
        self._check_inputs(input_ids, attention_mask, tokentype_ids, lm_labels)
        extended_attention_mask = self.bert_extended_attention_mask(attention_mask)
        if self.pre_process:
            position_ids = self.bert_position_ids(input_ids)
            encoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids,
                                           tokentype_ids=tokentype_ids)
        else:
            encoder_input = None
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(inference_context, self.encoder, encoder_input,
                                                             self.config)
            hidden = encoder_input if encoder_input is not None else self.encoder.input_tensor
            rotary_pos_emb = self.rotary_pos_emb(seq_len).to(hidden.device)
        hidden_states = self.encoder(
            hidden_states=encoder_input,
            attention_mask=extended_attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
        )
        if not self.post_process:
            return hidden_states
        if self.return_embeddings:
            return self._sentence_embeddings(hidden_states, attention_mask)
        pooled_output = self.pooler(hidden_states, 0) if self.add_binary_head else None
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.lm_head(hidden_states=hidden_states), weight=output_weight)
        binary_logits = self.binary_head(pooled_output) if self.binary_head is not None else None
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits
        return self.compute_language_model_loss(lm_labels, logits), binary_logits

    def _sentence_embeddings(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Per sample, the fp32 mean of the hidden states between the first and the last real token (the
        ``[CLS]`` and ``[SEP]`` of a right-padded sample), ``[b, h]``."""
        if self.config.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        lengths = attention_mask.sum(dim=1).to(torch.long)
        positions = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        inside = (positions[None, :] >= 1) & (positions[None, :] < (lengths[:, None] - 1))  # [b, s]
        inside = inside.to(torch.float32)
        summed = torch.einsum("sbh,bs->bh", hidden_states.float(), inside)
        return summed / inside.sum(dim=1, keepdim=True)

    def _check_inputs(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                      tokentype_ids: torch.Tensor | None, lm_labels: torch.Tensor | None) -> None:
        """Shapes and token types, checked before any compute; each error names the values."""
        if attention_mask is None or attention_mask.dim() != 2:
            shape = None if attention_mask is None else tuple(attention_mask.shape)
            raise ValueError(f"BertModel needs attention_mask of shape [b, s] (1 = token, 0 = padding), got {shape}")
        if self.pre_process:
            if input_ids is None or input_ids.dim() != 2:
                shape = None if input_ids is None else tuple(input_ids.shape)
                raise ValueError(f"BertModel needs input_ids of shape [b, s] on the first stage, got {shape}")
            if tuple(attention_mask.shape) != tuple(input_ids.shape):
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}")
            check_sequence_fits(input_ids.shape[1], self.max_sequence_length)
            if tokentype_ids is not None and self.num_tokentypes == 0:
                raise ValueError("tokentype_ids given but BertModel was built with num_tokentypes=0")
            if tokentype_ids is None and self.num_tokentypes > 0:
                raise ValueError(f"BertModel was built with num_tokentypes={self.num_tokentypes}: tokentype_ids "
                                 f"[b, s] are required")
            if tokentype_ids is not None and tuple(tokentype_ids.shape) != tuple(input_ids.shape):
                raise ValueError(f"tokentype_ids shape {tuple(tokentype_ids.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}")
        if lm_labels is not None and tuple(lm_labels.shape) != tuple(attention_mask.shape):
            raise ValueError(f"lm_labels shape {tuple(lm_labels.shape)} must equal attention_mask shape "
                             f"{tuple(attention_mask.shape)}")


def _set_mask_type(attention: ModuleSpec, current: Any, wanted: AttnMaskType, reason: str) -> None:
    """Switch the spec's self-attention mask type to ``wanted`` (with a warning), as Megatron-Core does."""
    if current != wanted:
        warnings.warn(f"{reason}: setting the BERT self-attention mask type from {current} to {wanted}", stacklevel=3)
        attention.params["attn_mask_type"] = wanted
