"""Attention of the NeMo audio encoder on fused kernels: flash-attention and Transformer Engine (both optional).

Both are imported when first used and raise an ``ImportError`` naming the extra to install. Parameter names match
the torch-only variants (``w_query``, ``w_key``, ``w_value``, ``out_proj``), so a checkpoint loads into any backend.
``MultiHeadAttentionWithTE`` always runs Transformer Engine in the packed ``thd`` layout: it takes either padded
``[b, t, d]`` input with ``lengths`` (it packs the valid rows, attends, and scatters them back, padding rows zero)
or packed ``[total, d]`` input with a ``PackedSeqParams``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_core.models.audio._attention_masks import causal_window_size
from megatron_core.models.audio._encoder_attention import _Projections


def _flash_attn_func(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``flash_attn.flash_attn_func``, imported on first use."""
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise ImportError("MultiHeadAttentionWithFA needs flash-attn, which is not installed: pip install "
                          "megatron-core-lite[flash], or use attn_impl='sdpa'") from err
    return flash_attn_func(*args, **kwargs)


def _te_dot_product_attention() -> type:
    """``transformer_engine.pytorch.DotProductAttention``, imported on first use."""
    try:
        from transformer_engine.pytorch import DotProductAttention
    except ImportError as err:
        raise ImportError("MultiHeadAttentionWithTE needs Transformer Engine, which is not installed: pip install "
                          "megatron-core-lite[te], or use attn_impl='sdpa'") from err
    return DotProductAttention


def resolve_attn_impl(impl: str) -> str:
    """``"auto"`` -> ``"te"`` when Transformer Engine imports, else ``"sdpa"``; other values unchanged."""
    if impl != "auto":
        return impl
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return "sdpa"
    return "te"


class MultiHeadAttentionWithFA(_Projections):
    """Attention through ``flash_attn_func`` on ``[b, t, heads, head_dim]`` (no padding mask, as in NeMo)."""

    def __init__(self, dim_in: int, dim_out: int, dropout: float = 0.0, qkv_bias: bool = False,
                 context_length: int = 1024, num_heads: int = 8, causal_mask: bool = False,
                 left_context: int | None = None) -> None:
        super().__init__(dim_in, dim_out, qkv_bias, num_heads)
        self.dropout = dropout
        self.causal_mask = causal_mask
        self.window_size = causal_window_size(causal_mask, left_context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend ``x`` ``[b, t, dim_in]`` to itself."""
        queries, keys, values = self._heads(x)
        window = {} if self.window_size is None else {"window_size": self.window_size}
        output = _flash_attn_func(queries, keys, values, dropout_p=self.dropout if self.training else 0.0,
                                  causal=self.causal_mask, **window)
        return self._merge(output.contiguous())


class MultiHeadAttentionWithTE(_Projections):
    """Attention through Transformer Engine's ``DotProductAttention`` in the ``thd`` layout (module docstring)."""

    def __init__(self, dim_in: int, dim_out: int, dropout: float = 0.0, qkv_bias: bool = False,
                 num_heads: int = 8, causal_mask: bool = False, left_context: int | None = None,
                 qk_norm: bool = False, **_: Any) -> None:
        super().__init__(dim_in, dim_out, qkv_bias, num_heads)
        self.causal_mask = causal_mask
        self.window_size = causal_window_size(causal_mask, left_context)
        self.qk_norm = qk_norm
        self.attn_mask_type = "padding_causal" if causal_mask else "padding"
        if qk_norm:
            self.q_norm = nn.LayerNorm(self.head_dim)
            self.k_norm = nn.LayerNorm(self.head_dim)
        te_kwargs: dict[str, Any] = dict(num_attention_heads=num_heads, kv_channels=self.head_dim,
                                         attention_dropout=dropout, qkv_format="thd",
                                         attn_mask_type=self.attn_mask_type, tp_size=1, tp_group=None,
                                         layer_number=1)
        if self.window_size is not None:
            te_kwargs["window_size"] = self.window_size
        self.te_attn = _te_dot_product_attention()(**te_kwargs)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None, packed_seq_params: Any = None,
                **_: Any) -> torch.Tensor:
        """Attend padded ``x`` ``[b, t, d]`` (with ``lengths``) or packed ``x`` ``[total, d]`` (with the params)."""
        valid = None
        if packed_seq_params is not None:
            packed = x.reshape(-1, x.shape[-1])
            cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
            max_q, max_kv = packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv
        else:
            batch, time = x.shape[:2]
            lengths32 = (torch.full((batch,), time, dtype=torch.int32, device=x.device) if lengths is None
                         else lengths.to(torch.int32))
            valid = torch.arange(time, device=x.device)[None, :] < lengths32[:, None]
            packed = x[valid]
            cu_q = cu_kv = nn.functional.pad(lengths32.cumsum(0, dtype=torch.int32), (1, 0))
            max_q = max_kv = int(lengths32.max())
        total = packed.shape[0]
        queries, keys, values = self._heads(packed)
        if total == 0:  # a batch without audio: TE cannot reshape an empty output
            output = queries.new_zeros(0, self.num_heads, self.head_dim)
        else:
            if self.qk_norm:
                queries, keys = self.q_norm(queries), self.k_norm(keys)
            output = self.te_attn(queries, keys, values, None, attn_mask_type=self.attn_mask_type,
                                  qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max_q,
                                  max_seqlen_kv=max_kv)
        output = self._merge(output.reshape(total, self.num_heads, self.head_dim))
        if valid is None:
            return output
        full = x.new_zeros(*x.shape[:2], self.d_out)
        full[valid] = output
        return full
