"""The fixed-batch KV cache (Megatron-Core's ``contexts.static_context.StaticInferenceContext``).

One contiguous buffer per layer, ``[max_sequence_length, max_batch_size, groups, head_dim]`` for
keys and for values (``key_value_memory_dict[layer_number]``). A forward on ``[b, s]`` tokens
writes rows ``batch_size_offset : +b`` at positions ``sequence_len_offset : +s`` and attends,
causally, to every cached position before them; the caller advances ``sequence_len_offset``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.contexts.rotary import rotate_at_positions

__all__ = ["StaticInferenceContext"]


class StaticInferenceContext(BaseInferenceContext):
    """KV cache for a batch of at most ``max_batch_size`` sequences of ``max_sequence_length`` tokens."""

    def __init__(self, max_batch_size: int, max_sequence_length: int, use_flashinfer_fused_rope: bool = False) -> None:
        super().__init__(materialize_only_last_token_logits=False)
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"StaticInferenceContext: max_batch_size ({max_batch_size}) and max_sequence_length "
                f"({max_sequence_length}) must be >= 1"
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decode_mode = False

    def is_static_batching(self) -> bool:
        """Always ``True``."""
        return True

    def enable_prefill_mode(self) -> None:
        """The next forward feeds prompts."""
        self.decode_mode = False

    def enable_decode_mode(self) -> None:
        """The next forwards feed one token per sequence."""
        self.decode_mode = True

    def is_decode_only(self) -> bool:
        """Whether the context is in decode mode."""
        return self.decode_mode

    def reset(self) -> None:
        """Start a new batch (the buffers are kept and overwritten)."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.decode_mode = False

    def swap_key_value_dict(self, batch_idx: torch.Tensor | list[int]) -> None:
        """Reorder the cached sequences along the batch dimension (e.g. after dropping finished ones)."""
        for layer, (k, v) in self.key_value_memory_dict.items():
            self.key_value_memory_dict[layer] = (k[:, batch_idx], v[:, batch_idx])

    def attention(
        self, attention: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary_pos_emb: Any,
    ) -> torch.Tensor:
        """Write this step's key/value into the buffers and attend causally over the cached prefix."""
        sq, b, np_, hn = query.shape
        self.check_attention_supported(attention)
        start, b0 = self.sequence_len_offset, self.batch_size_offset
        end = start + sq
        if end > self.max_sequence_length or b0 + b > self.max_batch_size:
            raise ValueError(
                f"StaticInferenceContext overflow: positions {start}..{end - 1} with max_sequence_length "
                f"{self.max_sequence_length}, batch rows {b0}..{b0 + b - 1} with max_batch_size {self.max_batch_size}"
            )
        positions = torch.arange(start, end, device=query.device)
        query, key = rotate_at_positions(query, key, rotary_pos_emb, positions, attention.config)
        layer = attention.layer_number
        if layer not in self.key_value_memory_dict:
            shape = (self.max_sequence_length, self.max_batch_size, key.shape[2], hn)
            self.key_value_memory_dict[layer] = (
                key.new_zeros(shape), value.new_zeros(shape),
            )
        k_mem, v_mem = self.key_value_memory_dict[layer]
        k_mem[start:end, b0 : b0 + b] = key
        v_mem[start:end, b0 : b0 + b] = value
        k = k_mem[:end, b0 : b0 + b].permute(1, 2, 0, 3)
        v = v_mem[:end, b0 : b0 + b].permute(1, 2, 0, 3)
        q = query.permute(1, 2, 0, 3)
        keep = torch.ones(sq, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        scale = getattr(getattr(attention, "core_attention", None), "softmax_scale", None)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=k.shape[1] != np_)
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
