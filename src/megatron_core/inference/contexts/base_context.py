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
        _check_gpt_oss_features(attention.config)

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


def _check_gpt_oss_features(config: Any) -> None:
    """Refuse what the KV-cache path would silently drop: attention sinks, YaRN's cosine/sine scaling, and the
    offset / clamped GLU on a SiLU MLP (which the fused decode step would run as a plain SwiGLU)."""
    import torch.nn.functional as F

    from megatron_core.transformer.rope_utils import yarn_concentration_factor

    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise ValueError(f"inference with attention sinks (softmax_type={softmax_type!r}) is not supported")
    factor = yarn_concentration_factor(config)
    if factor != 1.0:
        raise ValueError(f"inference with YaRN's attention scaling ({factor:.6g}, from yarn_rotary_scaling_factor="
                         f"{config.yarn_rotary_scaling_factor}) is not supported")
    offset, clamp = getattr(config, "glu_linear_offset", 0.0), getattr(config, "activation_func_clamp_value", None)
    if getattr(config, "activation_func", None) is F.silu and (offset != 0.0 or clamp is not None):
        raise ValueError(f"inference with a SiLU GLU with glu_linear_offset={offset} / activation_func_clamp_value="
                         f"{clamp} is not supported")
