"""The Mamba mixer's depthwise causal convolution followed by SiLU, on ``[b, l, channels]`` activations.

On CPU it is ``F.conv1d`` over the transposed activations (the reference). On an accelerator it is the same sum
written as ``kernel`` shifted multiply-adds over the channel-last layout, through :func:`megatron_core.jit.jit_fuser`:
``torch.compile`` makes the forward one element-wise kernel (no transposes, bias and SiLU fused, fp32 inside) and the
backward an element-wise kernel plus the weight's reduction over ``b, l``. Inside a compiled layer it is inlined.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.jit import jit_fuser

__all__ = ["causal_conv1d_silu"]


@jit_fuser
def _shifted_conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``silu(bias + sum_k weight[:, k] * x[:, t - (K - 1) + k])`` with zeros before the sequence, in fp32 (or wider)."""
    length, kernel = x.shape[1], weight.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.reshape(weight.shape[0], kernel).to(compute)
    padded = F.pad(x, (0, 0, kernel - 1, 0)).to(compute)
    acc = bias.to(compute) + padded[:, 0:length] * w[:, 0]
    for k in range(1, kernel):
        acc = acc + padded[:, k:k + length] * w[:, k]
    return F.silu(acc).to(x.dtype)


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``silu(causal depthwise conv(x))``: ``x`` ``[b, l, d]``, ``weight`` ``[d, 1, K]``, ``bias`` ``[d]``; ``[b, l, d]``."""
    if x.device.type == "cpu":
        out = F.conv1d(x.transpose(1, 2), weight, bias, padding=weight.shape[-1] - 1, groups=x.shape[-1])
        return F.silu(out[..., :x.shape[1]]).transpose(1, 2)
    return _shifted_conv_silu(x, weight, bias)
