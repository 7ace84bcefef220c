"""Gathers of Mamba states at chunk boundaries into a prefix-cache scratch buffer (Megatron-Core 0.19's
``ssm.ops.intermediate_extraction``).

Both functions copy only the first ``real_count_gpu[0]`` slots and leave the rest of ``out`` unchanged, without
reading the count on the host: each slot's new value is a ``torch.where`` between the gathered row and the slot's
current contents, so a captured CUDA graph replays them with any count (padding slots' indices are clamped into
range and their gathered rows discarded). Plain PyTorch on any device; 0.19 launches Triton kernels (CUDA only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["scatter_intermediate_conv", "scatter_intermediate_ssm"]


def _write_live_slots(out: torch.Tensor, indices: str, count: int, real_count_gpu: torch.Tensor,
                      rows: Callable[[], torch.Tensor]) -> None:
    """``out[i] = rows()[i]`` for the slots ``i < real_count_gpu[0]`` of the first ``count`` (the rest keep their
    contents); ``rows`` builds the ``count`` gathered rows, only when there are slots to write; ``indices`` names
    the argument that gave ``count``."""
    if count == 0:
        return
    if count > out.shape[0]:
        raise ValueError(f"{indices} length {count} exceeds scratch capacity {out.shape[0]}")
    if real_count_gpu.numel() != 1:
        raise ValueError(f"real_count_gpu must hold one value, got shape {tuple(real_count_gpu.shape)}")
    live = torch.arange(count, device=out.device) < real_count_gpu.to(out.device).reshape(())
    mask = live.view(count, *([1] * (out.dim() - 1)))
    out[:count] = torch.where(mask, rows().to(out.dtype), out[:count])


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
    _write_live_slots(out, "chunk_indices", chunk_indices.numel(), real_count_gpu,
                      lambda: states[chunk_indices.to(states.device).clamp(0, states.shape[0] - 1)])


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

    def windows() -> torch.Tensor:  # [count, conv_dim, d_conv]
        offsets = torch.arange(d_conv, device=src.device) - d_conv
        positions = (abs_positions.to(src.device, torch.int64)[:, None] + offsets).clamp(0, src.shape[1] - 1)
        return src[0][positions].transpose(1, 2)

    _write_live_slots(out, "abs_positions", abs_positions.numel(), real_count_gpu, windows)
