"""Torch-only attention modules of the NeMo audio encoder (``MultiHeadAttention``, ``MultiHeadAttentionWithSDPA``).

Both project with ``w_query`` / ``w_key`` / ``w_value`` (bias ``qkv_bias``) and ``out_proj`` (with bias), the
parameter names of NeMo's encoder checkpoints, and split heads as ``[b, t, heads, head_dim]``.
``MultiHeadAttention`` writes the softmax out and can keep a key/value cache for step-by-step decoding;
``MultiHeadAttentionWithSDPA`` calls ``torch.nn.functional.scaled_dot_product_attention`` and optionally
layer-normalises queries and keys per head (``qk_norm``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from megatron_core.models.audio._attention_masks import causal_disallow_mask, check_left_context


class _Projections(nn.Module):
    """The four projections shared by the attention variants."""

    def __init__(self, dim_in: int, dim_out: int, qkv_bias: bool, num_heads: int) -> None:
        super().__init__()
        if dim_out % num_heads:
            raise ValueError(f"dim_out ({dim_out}) must be divisible by num_heads ({num_heads})")
        self.d_out = dim_out
        self.num_heads = num_heads
        self.head_dim = dim_out // num_heads
        self.w_query = nn.Linear(dim_in, dim_out, bias=qkv_bias)
        self.w_key = nn.Linear(dim_in, dim_out, bias=qkv_bias)
        self.w_value = nn.Linear(dim_in, dim_out, bias=qkv_bias)
        self.out_proj = nn.Linear(dim_out, dim_out)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values ``[b, t, heads, head_dim]`` of ``x`` ``[b, t, dim_in]``."""
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        return self.w_query(x).view(shape), self.w_key(x).view(shape), self.w_value(x).view(shape)

    def _merge(self, heads_bthd: torch.Tensor) -> torch.Tensor:
        """``out_proj`` of the heads ``[b, t, heads, head_dim]`` concatenated."""
        return self.out_proj(heads_bthd.reshape(*heads_bthd.shape[:-2], self.d_out))


class MultiHeadAttention(_Projections):
    """Attention with an explicit softmax, a persistent ``mask`` buffer ``[context, context]`` and a KV cache."""

    def __init__(self, dim_in: int, dim_out: int, dropout: float = 0.0, qkv_bias: bool = False,
                 context_length: int = 1024, num_heads: int = 8, causal_mask: bool = False,
                 left_context: int | None = None) -> None:
        super().__init__(dim_in, dim_out, qkv_bias, num_heads)
        self.dropout = nn.Dropout(dropout)
        self.causal_mask = causal_mask
        self.left_context = check_left_context(causal_mask, left_context)
        mask = (causal_disallow_mask(context_length, context_length, self.left_context, torch.device("cpu"))
                if causal_mask else torch.zeros(context_length, context_length, dtype=torch.bool))
        self.register_buffer("mask", mask)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        """Attend ``x`` ``[b, t, dim_in]`` to itself (and, with ``use_cache``, to the cached earlier steps)."""
        queries, keys, values = self._heads(x)
        if use_cache:
            if self.cache_k is not None:
                keys = torch.cat((self.cache_k, keys), dim=1)
                values = torch.cat((self.cache_v, values), dim=1)
            self.cache_k, self.cache_v = keys, values
        queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))
        scores = queries @ keys.transpose(-1, -2)
        num_queries, num_keys = scores.shape[-2:]
        fits = num_queries <= self.mask.shape[0] and num_keys <= self.mask.shape[1]
        if self.causal_mask and not (num_keys == num_queries and fits):
            hidden = causal_disallow_mask(num_queries, num_keys, self.left_context, scores.device)
        else:
            hidden = self.mask[:num_queries, :num_keys]
        scores = scores.masked_fill(hidden.bool(), -torch.inf) / keys.shape[-1] ** 0.5
        weights = self.dropout(torch.softmax(scores, dim=-1))
        return self._merge((weights @ values).transpose(1, 2))

    def reset_cache(self) -> None:
        """Forget the cached keys and values."""
        self.cache_k = None
        self.cache_v = None


class MultiHeadAttentionWithSDPA(_Projections):
    """Attention through ``scaled_dot_product_attention``; ``attn_mask`` (bool, True = visible) broadcasts over
    ``[b, heads, t, t]``.

    With ``causal_mask`` and a padding mask, Megatron-Core passes both the mask and ``is_causal=True``, which recent
    torch combines but older versions and some kernels refuse; here the causal mask is folded into ``attn_mask``
    (same result).
    """

    def __init__(self, dim_in: int, dim_out: int, dropout: float = 0.0, qkv_bias: bool = False,
                 context_length: int = 1024, num_heads: int = 8, causal_mask: bool = False,
                 left_context: int | None = None, qk_norm: bool = False) -> None:
        super().__init__(dim_in, dim_out, qkv_bias, num_heads)
        self.dropout = dropout
        self.causal_mask = causal_mask
        self.left_context = check_left_context(causal_mask, left_context)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = nn.LayerNorm(self.head_dim)
            self.k_norm = nn.LayerNorm(self.head_dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, use_cache: bool = False
                ) -> torch.Tensor:
        """Attend ``x`` ``[b, t, dim_in]`` to itself; ``use_cache`` is accepted for interface parity and ignored."""
        del use_cache
        queries, keys, values = (t.transpose(1, 2) for t in self._heads(x))
        if self.qk_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        is_causal = self.causal_mask and attn_mask is None and self.left_context is None
        if self.causal_mask and not is_causal:
            visible = ~causal_disallow_mask(x.shape[1], x.shape[1], self.left_context, x.device)
            attn_mask = visible if attn_mask is None else attn_mask & visible
        output = scaled_dot_product_attention(queries, keys, values, attn_mask=attn_mask, is_causal=is_causal,
                                              dropout_p=self.dropout if self.training else 0.0)
        return self._merge(output.transpose(1, 2))
