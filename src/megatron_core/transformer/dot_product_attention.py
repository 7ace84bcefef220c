"""Core attention ``softmax(Q K^T * scale + mask) V`` on ``F.scaled_dot_product_attention``.

Megatron-Core's local ``DotProductAttention`` computes this with an explicit softmax; here SDPA
does it, so on GPU the flash / cuDNN / memory-efficient kernels run. With a causal mask type
and no mask tensor the ``is_causal=True`` fast path is used (no ``[s, s]`` mask is built).
Masks follow Megatron: boolean, ``True`` = masked out, broadcastable to ``[b, heads, sq, sk]``.
Attention dropout runs under the tracker's model-parallel RNG fork (each TP rank drops different
heads' probabilities), except under sequence parallelism where the block already forked.
Grouped-query attention is passed to SDPA as ``enable_gqa`` (no key/value copies).
Inputs are ``[s, b, heads, head_dim]`` (this TP rank's heads); the output is ``[sq, b, heads * head_dim]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core import tensor_parallel
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.transformer_config import TransformerConfig

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)


class DotProductAttention(MegatronModule):
    """Scaled dot-product attention over this tensor-parallel rank's heads."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config)
        if config.context_parallel_size > 1:
            raise ValueError("DotProductAttention does not support context_parallel_size > 1")
        if config.window_size is not None:
            raise ValueError(f"DotProductAttention does not support sliding-window attention (window_size={config.window_size})")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attend ``query`` ``[sq, b, np, hn]`` to ``key``/``value`` ``[sk, b, ng, hn]``; returns ``[sq, b, np*hn]``."""
        if packed_seq_params is not None:
            raise NotImplementedError("DotProductAttention: packed sequences are not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, np_, hn = query.shape
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        sdpa_mask, is_causal = _sdpa_mask(mask_type, attention_mask, sq, k.shape[2], query.device)
        if attention_bias is not None:
            sdpa_mask = _merge_bias(sdpa_mask, attention_bias, is_causal, sq, k.shape[2], q.dtype, q.device)
            is_causal = False
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = k.shape[1] != np_
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=self.softmax_scale, enable_gqa=gqa,
                )
        else:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=gqa,
            )
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def _sdpa_mask(
    mask_type: AttnMaskType, attention_mask: torch.Tensor | None, sq: int, sk: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """Translate Megatron's mask (True = masked) to SDPA's (True = attend) plus an ``is_causal`` flag."""
    if mask_type == AttnMaskType.no_mask:
        return None, False
    if mask_type in _CAUSAL_TYPES and attention_mask is None:
        if sq == sk or mask_type == AttnMaskType.causal:
            return None, sq > 1
        return _causal_keep(sq, sk, device), False
    if attention_mask is None:
        if mask_type == AttnMaskType.padding_causal:
            return _causal_keep(sq, sk, device), False
        return None, False
    keep = ~attention_mask.bool()
    if mask_type == AttnMaskType.padding_causal:
        keep = keep & _causal_keep(sq, sk, device)
    return keep, False


def _causal_keep(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal pattern: query i sees keys up to ``i + sk - sq``."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)


def _merge_bias(
    keep: torch.Tensor | None, bias: torch.Tensor, is_causal: bool, sq: int, sk: int, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """An additive float mask: the bias plus -inf where masked."""
    if is_causal:
        keep = _causal_keep(sq, sk, device)
    additive = bias.to(dtype)
    if keep is not None:
        additive = additive.masked_fill(~keep, float("-inf"))
    return additive
