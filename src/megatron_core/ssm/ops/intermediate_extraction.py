"""Gathers of Mamba states at chunk boundaries into a prefix-cache scratch buffer (Megatron-Core 0.19's
``ssm.ops.intermediate_extraction``).

Both functions copy only the first ``real_count_gpu[0]`` slots and leave the rest of ``out`` unchanged, without
reading the count on the host: each slot's new value is a ``torch.where`` between the gathered row and the slot's
current contents, so a captured CUDA graph replays them with any count (padding slots' indices are clamped into
range and their gathered rows discarded). Plain PyTorch on any device; 0.19 launches Triton kernels (CUDA only).
"""

from __future__ import annotations

import torch

__all__ = ["scatter_intermediate_conv", "scatter_intermediate_ssm"]


def _live_slots(count: int, real_count_gpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[count]`` bool: the slots below the runtime count."""
    if real_count_gpu.numel() != 1:
        raise ValueError(f"real_count_gpu must hold one value, got shape {tuple(real_count_gpu.shape)}")
    return torch.arange(count, device=device) < real_count_gpu.to(device).reshape(())


def scatter_intermediate_ssm(states: torch.Tensor, chunk_indices: torch.Tensor, real_count_gpu: torch.Tensor,
                             out: torch.Tensor) -> None:
    """``out[i] = states[chunk_indices[i]]`` for ``i < real_count_gpu[0]``.

    ``states`` ``[num_chunks, *state_shape]`` (the chunk scan's raw states of one layer), ``chunk_indices``
    ``[max_count]`` int64, ``out`` ``[>= max_count, *state_shape]`` (written in place).
    """
    if states.dim() < 2 or out.shape[1:] != states.shape[1:]:
        raise ValueError(f"scatter_intermediate_ssm: out {tuple(out.shape)} must be (slots, "
                         f"*{tuple(states.shape[1:])}) for states {tuple(states.shape)}")
    if chunk_indices.dtype != torch.int64:
        raise ValueError(f"scatter_intermediate_ssm: chunk_indices must be int64, got {chunk_indices.dtype}")
    count = chunk_indices.numel()
    if count == 0:
        return
    if count > out.shape[0]:
        raise ValueError(f"chunk_indices length {count} exceeds scratch capacity {out.shape[0]}")
    live = _live_slots(count, real_count_gpu, out.device)
    rows = states[chunk_indices.to(states.device).clamp(0, states.shape[0] - 1)].to(out.dtype)
    mask = live.view(count, *([1] * (out.dim() - 1)))
    out[:count] = torch.where(mask, rows, out[:count])


def scatter_intermediate_conv(src: torch.Tensor, abs_positions: torch.Tensor, real_count_gpu: torch.Tensor,
                              out: torch.Tensor, d_conv: int) -> None:
    """``out[i, :, j] = src[0, abs_positions[i] - d_conv + j]`` (positions clamped into the sequence) for
    ``i < real_count_gpu[0]``: the ``d_conv`` inputs before each position, transposed to a convolution state.

    ``src`` ``[1, seq_len, conv_dim]`` (the convolution's inputs), ``abs_positions`` ``[max_count]`` int32,
    ``out`` ``[>= max_count, conv_dim, d_conv]`` (written in place).
    """
    if src.dim() != 3 or src.shape[0] != 1:
        raise ValueError(f"scatter_intermediate_conv: src {tuple(src.shape)} must be (1, seq_len, conv_dim)")
    if out.dim() != 3 or out.shape[1:] != (src.shape[2], d_conv):
        raise ValueError(f"scatter_intermediate_conv: out {tuple(out.shape)} must be (slots, {src.shape[2]}, "
                         f"{d_conv})")
    if abs_positions.dtype != torch.int32:
        raise ValueError(f"scatter_intermediate_conv: abs_positions must be int32, got {abs_positions.dtype}")
    count = abs_positions.numel()
    if count == 0:
        return
    if count > out.shape[0]:
        raise ValueError(f"abs_positions length {count} exceeds scratch capacity {out.shape[0]}")
    live = _live_slots(count, real_count_gpu, out.device)
    offsets = torch.arange(d_conv, device=src.device) - d_conv
    positions = (abs_positions.to(src.device, torch.int64)[:, None] + offsets).clamp(0, src.shape[1] - 1)
    windows = src[0][positions].transpose(1, 2).to(out.dtype)  # [count, conv_dim, d_conv]
    out[:count] = torch.where(live[:, None, None], windows, out[:count])
