"""GEMM FLOP counts of the NeMo audio tower (the estimate ``NemoTransformerAudioModel.estimate_flops`` reports).

Counted: the pre-encoder's convolutions or stacking projection, per layer the Q/K/V/out projections and the two
feed-forward linears (``24 t d^2``) and the attention score and value products (``4 d`` per query-key pair).
Norms, activations, softmax and masking are left out, like Megatron's language-model estimate.
"""

from __future__ import annotations

import torch

from megatron_core.models.audio.audio_feature_config import ceil_div


def post_subsample_lengths(pre_encode: str, subsampling_factor: int, lengths: torch.Tensor) -> torch.Tensor:
    """Valid encoder steps of clips of ``lengths`` mel frames."""
    if pre_encode in ("conv", "depth_conv"):
        return torch.div(torch.div(lengths, 2, rounding_mode="floor"), 2, rounding_mode="floor")
    if pre_encode == "stacking":
        return torch.div(lengths + subsampling_factor - 1, subsampling_factor, rounding_mode="floor")
    raise ValueError(f"pre_encode ({pre_encode!r}) must be one of 'conv', 'depth_conv', 'stacking'")


def pre_encode_flops(pre_encode: str, subsampling_factor: int, n_mels: int, d_model: int, batch: int,
                     frames: int) -> int:
    """Forward FLOPs of the pre-encoder on a padded ``[batch, n_mels, frames]`` input."""
    t1 = frames
    t2 = ceil_div(t1, 2)
    t3 = ceil_div(t2, 2)
    first = 2 * batch * t1 * d_model * n_mels * 3
    if pre_encode == "conv":
        return first + 2 * batch * (t2 + t3) * d_model * d_model * 3
    if pre_encode == "depth_conv":
        return first + 2 * batch * (t2 + t3) * (d_model * 3 + d_model * d_model)
    if pre_encode == "stacking":
        stacked = ceil_div(frames, subsampling_factor)
        return 2 * batch * stacked * subsampling_factor * n_mels * d_model
    raise ValueError(f"pre_encode ({pre_encode!r}) must be one of 'conv', 'depth_conv', 'stacking'")


def attention_pairs(lengths: torch.Tensor, causal: bool, left_context: int | None) -> torch.Tensor:
    """Query-key pairs attended over clips of ``lengths`` steps (float64 sum)."""
    lengths = lengths.to(torch.float64)
    if not causal:
        return (lengths * lengths).sum()
    triangle = lengths * (lengths + 1.0) / 2.0
    if left_context is None or left_context < 0:
        return triangle.sum()
    window = float(left_context + 1)
    banded = window * (window + 1.0) / 2.0 + (lengths - window).clamp_min(0.0) * window
    return torch.where(lengths <= window, triangle, banded).sum()
