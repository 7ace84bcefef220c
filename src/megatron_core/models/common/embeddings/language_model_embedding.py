"""Word (+ learned position) embeddings for language models (Megatron-Core's ``LanguageModelEmbedding``).

Input ids ``[b, s]`` become ``[s, b, h]`` activations (sequence-first). The word table is
vocab-parallel (each TP rank holds a slice of rows). Under sequence parallelism the output is
scattered along the sequence, so each TP rank continues with ``[s/TP, b, h]``; without position
embeddings this is fused into the vocab embedding's reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._ground import register_fsdp_unit
from megatron_core.device import get_current_device
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["LanguageModelEmbedding"]


@register_fsdp_unit
class LanguageModelEmbedding(MegatronModule):
    """``word_embeddings`` (vocab-parallel), optional ``position_embeddings`` and ``tokentype_embeddings``."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        tp_group: Any = None,
    ) -> None:
        super().__init__(config)
        self.tp_group = resolve_tp_group(tp_group)
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding
            and num_tokentypes <= 0
            and config.sequence_parallel
            and scatter_to_sequence_parallel
        )
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=vocab_size,
            embedding_dim=config.hidden_size,
            init_method=config.embedding_init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
            tp_group=self.tp_group,
        )
        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(
                max_sequence_length, config.hidden_size, dtype=config.params_dtype, device=_init_device(config)
            )
            if config.perform_initialization:
                config.embedding_init_method(self.position_embeddings.weight)
        if num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(
                num_tokentypes, config.hidden_size, dtype=config.params_dtype, device=_init_device(config)
            )
            if config.perform_initialization:
                config.embedding_init_method(self.tokentype_embeddings.weight)
        else:
            self.tokentype_embeddings = None
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def zero_parameters(self) -> None:
        """Zero every embedding table (used by tests and by tied-weight set-up)."""
        for param in self.parameters():
            param.data.fill_(0)
            param.shared = True

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, tokentype_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Embed ``input_ids`` ``[b, s]``; returns ``[s, b, h]`` (``[s/TP, b, h]`` under sequence parallelism)."""
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                raise ValueError("LanguageModelEmbedding with learned_absolute positions needs position_ids [b, s]")
            embeddings = embeddings + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            embeddings = embeddings.transpose(0, 1).contiguous()
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given but the embedding was built with num_tokentypes=0")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids).permute(1, 0, 2)
        if self.config.use_mup and self.config.mup_embedding_mult != 1.0:
            embeddings = embeddings * self.config.mup_embedding_mult
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if not self.config.sequence_parallel:
            return self.embedding_dropout(embeddings)
        if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
            if self.config.clone_scatter_output_in_embedding:
                embeddings = embeddings.clone()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.embedding_dropout(embeddings)


def _init_device(config: TransformerConfig) -> torch.device:
    return torch.device("cpu") if config.use_cpu_initialization else get_current_device()
