"""The inference-context interface the model's attention calls (Megatron-Core's ``BaseInferenceContext``).

A context owns the KV cache of a generation. ``SelfAttention.forward`` hands its query, key and
value (before rotary embedding) to :meth:`BaseInferenceContext.attention`, which rotates them at
each token's own position, stores key/value in the cache and attends over everything cached so
far. ``GPTModel`` asks :meth:`select_logit_hidden_states` which token positions need logits.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

__all__ = ["BaseInferenceContext"]


class BaseInferenceContext(abc.ABC):
    """Common interface of the static and dynamic contexts."""

    def __init__(self, materialize_only_last_token_logits: bool = True) -> None:
        self.materialize_only_last_token_logits = materialize_only_last_token_logits

    @abc.abstractmethod
    def is_static_batching(self) -> bool:
        """Whether this is the fixed-batch (static) context."""

    def is_dynamic_batching(self) -> bool:
        """Whether this is the continuous-batching (dynamic) context."""
        return not self.is_static_batching()

    @abc.abstractmethod
    def is_decode_only(self) -> bool:
        """Whether every sequence in the current step contributes exactly one new token."""

    @abc.abstractmethod
    def attention(
        self, attention: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary_pos_emb: Any,
    ) -> torch.Tensor:
        """Store key/value of the current step and attend; returns the core-attention output ``[sq, b, np*hn]``."""

    def attention_from_qkv(self, attention: Any, mixed_qkv: torch.Tensor, rotary_pos_emb: Any) -> torch.Tensor:
        """:meth:`attention` from ``linear_qkv``'s fused output ``[sq, b, ...]``, which ``attention`` splits (a
        context may instead rotate and cache the projection in place)."""
        query, key, value = attention._split_qkv(mixed_qkv)
        return self.attention(attention, query, key, value, rotary_pos_emb)

    @staticmethod
    def check_attention_supported(attention: Any) -> None:
        """Raise ``ValueError`` for attention the contexts cannot serve (sliding windows)."""
        if getattr(attention.config, "window_size", None) is not None:
            raise ValueError(f"inference with sliding-window attention (window_size={attention.config.window_size}) "
                             "is not supported")

    def select_logit_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The hidden states ``[s, b, h]`` whose logits are needed (all of them by default)."""
        return hidden_states

    @property
    def max_sequence_length(self) -> int:
        """Longest sequence (prompt + generated) the context holds."""
        return self._max_sequence_length

    @max_sequence_length.setter
    def max_sequence_length(self, value: int) -> None:
        self._max_sequence_length = value
