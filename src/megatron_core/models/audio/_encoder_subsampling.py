"""Time subsampling at the input of the NeMo audio encoder: mel frames ``[b, n_mels, t]`` -> ``[b, t', d_model]``.

``ConvSubsampling``: conv(k3) then two stride-2 convs, GELU after each (4x). ``DepthwiseConvSubsampling``: the
strided convs split into depthwise + pointwise (4x). Lengths are floor-halved twice although the convs output
``ceil`` frames. ``NGPTStackingSubsampling``: pads time to a multiple of the factor, replaces every all-zero frame
(padding, and any silent frame that is exactly zero) by the learned ``pad_frame``, stacks ``factor`` frames and
projects them; lengths are ceil-divided.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import Conv1d


class ConvSubsampling(nn.Module):
    """4x subsampling by ``conv1`` (k3, s1), ``conv2`` and ``conv3`` (k3, s2, p1), each followed by GELU."""

    def __init__(self, n_mels: int = 80, d_model: int = 512) -> None:
        super().__init__()
        self.conv1 = Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.conv3 = Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.gelu = nn.GELU()

    def forward(self, x: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[b, n_mels, t]`` -> ``([b, ceil(ceil(t / 2) / 2), d_model], length // 2 // 2)``."""
        x = self.gelu(self.conv1(x))
        x = self.gelu(self.conv2(x))
        x = self.gelu(self.conv3(x))
        return x.transpose(1, 2), length // 2 // 2


class DepthwiseConvSubsampling(nn.Module):
    """4x subsampling with depthwise-separable strided convs (``dw_conv*`` groups=d_model, ``pw_conv*`` 1x1)."""

    def __init__(self, n_mels: int = 80, d_model: int = 512) -> None:
        super().__init__()
        self.conv1 = Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.dw_conv2 = Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1, groups=d_model)
        self.pw_conv2 = Conv1d(d_model, d_model, kernel_size=1)
        self.dw_conv3 = Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1, groups=d_model)
        self.pw_conv3 = Conv1d(d_model, d_model, kernel_size=1)
        self.gelu = nn.GELU()

    def forward(self, x: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[b, n_mels, t]`` -> ``([b, t', d_model], length // 2 // 2)``."""
        x = self.gelu(self.conv1(x))
        x = self.gelu(self.pw_conv2(self.dw_conv2(x)))
        x = self.gelu(self.pw_conv3(self.dw_conv3(x)))
        return x.transpose(1, 2), length // 2 // 2


class NGPTStackingSubsampling(nn.Module):
    """Stack ``subsampling_factor`` frames and project them with ``proj_out`` (see the module docstring)."""

    def __init__(self, subsampling_factor: int, feat_in: int, feat_out: int, use_bias: bool = False) -> None:
        super().__init__()
        self.subsampling_factor = subsampling_factor
        self.proj_out = nn.Linear(subsampling_factor * feat_in, feat_out, bias=use_bias)
        self.pad_frame = nn.Parameter(torch.ones(feat_in, dtype=torch.float32))

    def forward(self, x: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[b, feat_in, t]`` -> ``([b, ceil(t / factor), feat_out], ceil(length / factor))``."""
        factor = self.subsampling_factor
        x = x.transpose(1, 2)
        batch, time, feat = x.shape
        x = nn.functional.pad(x, (0, 0, 0, (-time) % factor))
        empty = (x == 0).all(dim=-1, keepdim=True)
        x = torch.where(empty, self.pad_frame.to(x.dtype), x)
        x = x.reshape(batch, x.shape[1] // factor, factor * feat)
        return self.proj_out(x), torch.div(length + factor - 1, factor, rounding_mode="floor")
