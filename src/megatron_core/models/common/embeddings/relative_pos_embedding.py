"""T5-style relative position bias (Megatron-Core's ``RelativePositionEmbedding``).

Each (query, key) offset ``key_position - query_position`` falls into one of ``num_buckets`` buckets:
exact buckets for small offsets, then logarithmically wider ones up to ``max_distance`` (beyond it all
offsets share the last bucket). A bidirectional embedding gives past and future offsets separate halves
of the buckets; a unidirectional one (a causal decoder) folds future offsets into bucket 0. Each bucket
holds one learned scalar per attention head; the bias ``[1, heads, sq, sk]`` is added to the attention
scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from megatron_core._ground import get_pg_size

__all__ = ["RelativePositionEmbedding"]


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """The bucket (``int64`` in ``[0, num_buckets)``) of every offset in ``relative_position`` (key minus query)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    # Distances of at least ``exact`` are spread over the remaining buckets on a log scale.
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionEmbedding(torch.nn.Module):
    """Learned per-head bias for each relative-position bucket: ``relative_attention_bias`` ``[buckets, heads]``."""

    def __init__(
        self,
        bidirectional: bool,
        init_method: Callable[[torch.Tensor], Any],
        num_attention_heads: int,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
    ) -> None:
        super().__init__()
        exact = (relative_attention_num_buckets // 2 if bidirectional else relative_attention_num_buckets) // 2
        if exact < 1 or relative_attention_max_distance <= exact:
            raise ValueError(
                f"RelativePositionEmbedding: relative_attention_num_buckets ({relative_attention_num_buckets}) must "
                f"be at least {4 if bidirectional else 2} (bidirectional={bidirectional}) and "
                f"relative_attention_max_distance ({relative_attention_max_distance}) larger than the {exact} exact "
                "buckets"
            )
        self.bidirectional = bidirectional
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.relative_attention_bias = torch.nn.Embedding(relative_attention_num_buckets, num_attention_heads)
        init_method(self.relative_attention_bias.weight)

    def forward(self, query_seq_length: int, key_seq_length: int) -> torch.Tensor:
        """The bias ``[1, heads, query_seq_length, key_seq_length]`` (all heads; the model splits it over TP)."""
        device = self.relative_attention_bias.weight.device
        query = torch.arange(query_seq_length, dtype=torch.long, device=device)[:, None]
        key = torch.arange(key_seq_length, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(key - query, self.bidirectional, self.relative_attention_num_buckets,
                                           self.relative_attention_max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    @staticmethod
    def get_relative_seq_len(
        inference_context: Any, transformer: Any, transformer_input: torch.Tensor | None, transformer_config: Any,
        *, inference_params: Any = None,
    ) -> int:
        """The full sequence length the bias must cover (undoing the sequence-parallel split)."""
        inference_context = inference_context if inference_context is not None else inference_params
        if inference_context is not None:
            return inference_context.max_sequence_length
        source = transformer.input_tensor if transformer.input_tensor is not None else transformer_input
        seq_len = source.size(0)
        if transformer_config.sequence_parallel:
            seq_len *= get_pg_size(transformer.tp_group)
        return seq_len
