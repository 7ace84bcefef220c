"""NeMo's audio ``TransformerEncoder`` (Megatron-Core's ``models.audio.nemo_transformer_encoder``).

Mel features ``[b, n_mels, t]`` are subsampled in time (``pre_encode``: ``"conv"``, ``"depth_conv"`` or
``"stacking"``), scaled by ``sqrt(d_model)``, layer-normed, run through ``n_layers`` pre-norm blocks and a final
layer norm; the result is ``[b, d_model, t']`` (or, with ``return_packed``, the valid rows ``[total, d_model]``).
With Transformer Engine attention the valid rows are packed once and the blocks run on ``[total, d_model]``; the
other backends keep the padded layout with a key-padding mask (padded query rows then hold values that callers
mask out). The parts live in private modules and are re-exported here, where Megatron-Core has them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_core.models.audio._attention_masks import check_left_context
from megatron_core.models.audio._encoder_attention import MultiHeadAttention, MultiHeadAttentionWithSDPA
from megatron_core.models.audio._encoder_attention_kernels import (
    MultiHeadAttentionWithFA,
    MultiHeadAttentionWithTE,
    resolve_attn_impl,
)
from megatron_core.models.audio._encoder_layers import (
    GELU,
    FeedForward,
    GPTConfig,
    LayerNorm,
    TransformerBlock,
    TransformerEncoderConfig,
    apply_rope,
    compute_rope_params,
)
from megatron_core.models.audio._encoder_subsampling import (
    ConvSubsampling,
    DepthwiseConvSubsampling,
    NGPTStackingSubsampling,
)
from megatron_core.packed_seq_params import PackedSeqParams

__all__ = [
    "ConvSubsampling", "DepthwiseConvSubsampling", "FeedForward", "GELU", "GPTConfig", "LayerNorm",
    "MultiHeadAttention", "MultiHeadAttentionWithFA", "MultiHeadAttentionWithSDPA", "MultiHeadAttentionWithTE",
    "NGPTStackingSubsampling", "TransformerBlock", "TransformerEncoder", "TransformerEncoderConfig", "apply_rope",
    "compute_rope_params", "logger",
]

logger = logging.getLogger(__name__)


def _pre_encoder(pre_encode: str, n_mels: int, d_model: int, subsampling_factor: int) -> nn.Module:
    if pre_encode == "conv":
        return ConvSubsampling(n_mels, d_model)
    if pre_encode == "depth_conv":
        return DepthwiseConvSubsampling(n_mels, d_model)
    if pre_encode == "stacking":
        return NGPTStackingSubsampling(subsampling_factor=subsampling_factor, feat_in=n_mels, feat_out=d_model)
    raise ValueError(f"pre_encode ({pre_encode!r}) must be one of 'conv', 'depth_conv', 'stacking'")


def _valid_rows(lengths: torch.Tensor, time: int) -> torch.Tensor:
    return torch.arange(time, device=lengths.device)[None, :] < lengths[:, None]


class TransformerEncoder(nn.Module):
    """Subsampling front end + transformer blocks (module docstring); keys ``pre_encode.*``, ``layers.<i>.*``,
    ``layer_norm``, ``final_norm``."""

    def __init__(self, n_mels: int = 80, d_model: int = 512, n_heads: int = 8, n_layers: int = 17,
                 drop_rate: float = 0.1, qkv_bias: bool = False, causal_mask: bool = False, pre_encode: str = "conv",
                 nan_debug: bool = True, qk_norm: bool = False, subsampling_factor: int = 4,
                 attn_impl: str = "auto", recompute_layers: bool = False, left_context: int | None = None) -> None:
        super().__init__()
        self.d_model = d_model
        self.nan_debug = nan_debug
        self.recompute_layers = recompute_layers
        self.left_context = check_left_context(causal_mask, left_context)
        self.pre_encode = _pre_encoder(pre_encode, n_mels, d_model, subsampling_factor)
        cfg = TransformerEncoderConfig(d_model=d_model, n_heads=n_heads, n_layers=n_layers, drop_rate=drop_rate,
                                       qkv_bias=qkv_bias, causal_mask=causal_mask, qk_norm=qk_norm,
                                       attn_impl=attn_impl, recompute_layers=recompute_layers,
                                       left_context=self.left_context)
        self.attn_impl = resolve_attn_impl(cfg.attn_impl)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(n_layers)])
        self.layer_norm = nn.LayerNorm(d_model)
        self.final_norm = nn.LayerNorm(d_model)

    def _run_layer(self, layer: nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.recompute_layers and self.training and hidden.requires_grad:
            return checkpoint(lambda h: layer(h, **kwargs), hidden, use_reentrant=False)
        return layer(hidden, **kwargs)

    def _blocks(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = self._run_layer(layer, x, **kwargs)
            self._maybe_check(x, f"layer_{index}")
        x = self.final_norm(x)
        self._maybe_check(x, "final_norm")
        return x

    def forward(self, audio_signal: torch.Tensor, length: torch.Tensor, packed_seq_params: Any = None,
                return_packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``audio_signal`` ``[b, n_mels, t]`` and frame counts ``[b]`` -> ``([b, d_model, t'], lengths [b])``.

        ``return_packed``: ``([total, d_model], lengths)`` with only the valid rows. ``packed_seq_params`` is
        passed to the blocks unchanged (the padded path; reserved for loader-side packing, as in Megatron-Core).
        """
        x, length = self.pre_encode(audio_signal, length)
        self._maybe_check(x, "pre_encode")
        x = x * self.d_model ** 0.5
        self._maybe_check(x, "embedding_scale")
        x = self.layer_norm(x)
        self._maybe_check(x, "layer_norm")
        batch, time = x.shape[:2]
        if self.attn_impl == "te" and packed_seq_params is None:
            lengths32 = length.to(torch.int32)
            valid = _valid_rows(lengths32, time)
            max_len = int(lengths32.max()) if lengths32.numel() else 0
            if max_len == 0:  # no audio on this rank: skip the blocks
                packed = x.new_zeros(0, self.d_model)
            else:
                cu_seqlens = nn.functional.pad(lengths32.cumsum(0, dtype=torch.int32), (1, 0))
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                         max_seqlen_q=max_len, max_seqlen_kv=max_len)
                packed = self._blocks(x[valid], packed_seq_params=params)
            if return_packed:
                return packed, length
            x = x.new_zeros(batch, time, self.d_model)
            x[valid] = packed
            return x.transpose(1, 2), length
        attn_mask = _valid_rows(length, time)[:, None, None, :]
        x = self._blocks(x, attn_mask=attn_mask, lengths=length, packed_seq_params=packed_seq_params)
        if return_packed:
            return x[_valid_rows(length.to(torch.int32), time)], length
        return x.transpose(1, 2), length

    def _maybe_check(self, x: torch.Tensor, name: str) -> None:
        if self.nan_debug:
            self._check_nan(x, name)

    def _check_nan(self, x: torch.Tensor, name: str) -> None:
        x = x.detach()
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            finite = x[~bad]
            abs_max = float(finite.abs().max()) if finite.numel() else float("nan")
            logger.error("[NaN DEBUG] %s: NaN=%d, Inf=%d, abs_max=%.6f, shape=%s", name, int(torch.isnan(x).sum()),
                         int(torch.isinf(x).sum()), abs_max, list(x.shape))
            raise RuntimeError(f"[NaN DEBUG] NaN/Inf detected at '{name}'. Stopping training.")

    def reset_cache(self) -> None:
        """Clear every block's key/value cache (a no-op for backends without one)."""
        for layer in self.layers:
            layer.reset_cache()

    def freeze(self) -> None:
        """Stop gradients to every encoder parameter."""
        for param in self.parameters():
            param.requires_grad = False

    def unfreeze(self, partial: bool = False) -> None:
        """Let gradients reach every encoder parameter (``partial`` is accepted and ignored, as in Megatron-Core)."""
        del partial
        for param in self.parameters():
            param.requires_grad = True
