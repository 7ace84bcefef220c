"""The transformer block of the NeMo audio encoder and its small parts (norm, feed-forward, GELU, rotary helpers).

``TransformerBlock`` is pre-norm: ``h = x + drop(mha(pre_norm(x)))``, ``out = h + drop(ffn(post_norm(h)))`` with a
``4 * d_model`` GELU feed-forward (keys ``ffn.ffn.0`` / ``ffn.ffn.2``) and ``LayerNorm``s whose parameters are
named ``scale`` / ``shift``, as in NeMo's checkpoints. ``GPTConfig``, ``GELU``, ``compute_rope_params`` and
``apply_rope`` are helpers NeMo's module also exports; the encoder itself does not use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_core.models.audio._encoder_attention import MultiHeadAttentionWithSDPA
from megatron_core.models.audio._encoder_attention_kernels import (
    MultiHeadAttentionWithFA,
    MultiHeadAttentionWithTE,
    resolve_attn_impl,
)


@dataclass
class GPTConfig:
    """Sizes of a GPT-style decoder (a NeMo helper kept for API parity)."""

    vocab_size: int = 50257
    context_length: int = 1024
    emb_dim: int = 768
    n_heads: int = 12
    n_layers: int = 12
    drop_rate: float = 0.1
    qkv_bias: bool = False
    theta_base: int = 10_000


@dataclass
class TransformerEncoderConfig:
    """Settings of one encoder block: width, heads, dropout, masks and the attention backend.

    ``attn_impl``: ``"auto"`` (Transformer Engine when installed, else ``"sdpa"``), ``"te"``, ``"sdpa"`` or ``"fa"``.
    ``left_context``: with ``causal_mask``, how many earlier positions each one sees (``None``: all).
    """

    n_mels: int = 80
    d_model: int = 512
    n_heads: int = 12
    n_layers: int = 12
    drop_rate: float = 0.1
    qkv_bias: bool = False
    causal_mask: bool = False
    theta_base: int = 10_000
    context_length: int = 4096
    qk_norm: bool = False
    attn_impl: str = "auto"
    recompute_layers: bool = False
    left_context: int | None = None


class FeedForward(nn.Module):
    """``Linear(dim, 4 dim) -> GELU -> Linear(4 dim, dim)`` (submodule ``ffn``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward of ``x`` ``[..., dim]``."""
        return self.ffn(x)


class GELU(nn.Module):
    """GELU in its tanh approximation, ``x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The activation of ``x``."""
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class LayerNorm(nn.Module):
    """Layer norm over the last dimension with parameters ``scale`` and ``shift``, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * (x - mean) / sqrt(var + eps) + shift``, returned in ``x``'s dtype."""
        x32 = x.float()
        mean = x32.mean(dim=-1, keepdim=True)
        var = x32.var(dim=-1, keepdim=True, unbiased=False)
        return (self.scale * (x32 - mean) / torch.sqrt(var + self.eps) + self.shift).to(x.dtype)


def compute_rope_params(head_dim: int, theta_base: float = 10_000, context_length: int = 4096,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary ``(cos, sin)`` tables ``[context_length, head_dim]`` (each frequency used for both halves)."""
    if head_dim % 2:
        raise ValueError(f"head_dim ({head_dim}) must be even for rotary embeddings")
    inv_freq = 1.0 / theta_base ** (torch.arange(0, head_dim, 2, dtype=dtype).float() / head_dim)
    angles = torch.arange(context_length, dtype=dtype)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, t, head_dim]`` by the first ``t`` rows of the tables (rotate-half layout)."""
    head_dim, seq_len = x.shape[-1], x.shape[-2]
    if head_dim % 2:
        raise ValueError(f"head_dim ({head_dim}) must be even for rotary embeddings")
    first, second = x[..., :head_dim // 2], x[..., head_dim // 2:]
    rotated = torch.cat((-second, first), dim=-1)
    return (x * cos[:seq_len] + rotated * sin[:seq_len]).to(x.dtype)


def _attention(cfg: TransformerEncoderConfig, impl: str) -> nn.Module:
    common: dict[str, Any] = dict(dim_in=cfg.d_model, dim_out=cfg.d_model, dropout=cfg.drop_rate,
                                  qkv_bias=cfg.qkv_bias, num_heads=cfg.n_heads, causal_mask=cfg.causal_mask,
                                  left_context=cfg.left_context)
    if impl == "te":
        return MultiHeadAttentionWithTE(**common, qk_norm=cfg.qk_norm)
    if impl == "sdpa":
        return MultiHeadAttentionWithSDPA(**common, qk_norm=cfg.qk_norm)
    if impl == "fa":
        return MultiHeadAttentionWithFA(**common)
    raise ValueError(f"attn_impl ({cfg.attn_impl!r}) must be one of 'auto', 'te', 'sdpa', 'fa'")


class TransformerBlock(nn.Module):
    """One pre-norm encoder block (module docstring); the attention backend follows ``cfg.attn_impl``."""

    def __init__(self, cfg: TransformerEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pre_norm = LayerNorm(cfg.d_model)
        self.attn_impl = resolve_attn_impl(cfg.attn_impl)
        self.mha = _attention(cfg, self.attn_impl)
        self.dropout = nn.Dropout(cfg.drop_rate)
        self.post_norm = LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                packed_seq_params: Any = None, use_cache: bool = False) -> torch.Tensor:
        """The block on ``x`` ``[b, t, d]`` (or packed ``[total, d]`` with ``packed_seq_params``, TE only).

        ``attn_mask`` is used by SDPA, ``lengths`` / ``packed_seq_params`` by Transformer Engine.
        """
        normed = self.pre_norm(x)
        if self.attn_impl == "te":
            if packed_seq_params is not None:
                attended = self.mha(normed, packed_seq_params=packed_seq_params)
            else:
                attended = self.mha(normed, lengths=lengths)
        elif self.attn_impl == "sdpa":
            attended = self.mha(normed, attn_mask=attn_mask, use_cache=use_cache)
        else:
            attended = self.mha(normed)
        hidden = x + self.dropout(attended)
        return hidden + self.dropout(self.ffn(self.post_norm(hidden)))

    def reset_cache(self) -> None:
        """Clear the attention's key/value cache when it keeps one."""
        reset = getattr(self.mha, "reset_cache", None)
        if callable(reset):
            reset()
