"""The rotary embedding of multi-latent attention: its own angle table, DeepSeek's channel layout, the scale.

MLA rotates only the ``qk_pos_emb_head_dim`` position channels of each query head and of the one key
part shared by all heads, with a table it builds itself (``rope_type='rope'``: plain RoPE;
``'yarn'``: YaRN with ``rotary_scaling_factor``, whose cosines and sines are scaled by YaRN's
concentration factor). DeepSeek's weights produce those channels as interleaved pairs
``(x0, x1), (x2, x3), ...``; as Megatron-Core does, they are reordered to ``(x0, x2, ..., x1, x3, ...)`` and
then rotated half-split, which is the same rotation as Hugging Face's ``rope_interleave=True`` (and leaves
query and key in the same reordered layout, so their dot products are unchanged).

The softmax scale is ``mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)`` with
``mscale = 0.1 * mscale_all_dim * ln(rotary_scaling_factor) + 1`` (1 when the factor is <= 1), for either
``rope_type``, as Megatron-Core computes it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_core.transformer.rope_utils import apply_rotary_pos_emb, yarn_mscale
from megatron_core.transformer.rotary_pos_embedding import RotaryEmbedding
from megatron_core.transformer.yarn_rotary_pos_embedding import YarnRotaryEmbedding

__all__ = ["build_mla_rotary_embedding", "deinterleave_rope_channels", "mla_softmax_scale", "rotary_angles",
           "rotate_mla"]


def mla_softmax_scale(config: Any) -> float:
    """``mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)`` (see the module docstring)."""
    mscale = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def build_mla_rotary_embedding(config: Any, cp_group: Any = None) -> torch.nn.Module:
    """The ``RotaryEmbedding`` (``rope_type='rope'``) or ``YarnRotaryEmbedding`` (``'yarn'``) of one MLA layer."""
    dim = config.qk_pos_emb_head_dim
    cpu = config.use_cpu_initialization
    if config.rope_type == "rope":
        return RotaryEmbedding(dim, rotary_percent=config.rotary_percent, rotary_base=config.rotary_base,
                               use_cpu_initialization=cpu, cp_group=cp_group)
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(
            dim, rotary_base=config.rotary_base, use_cpu_initialization=cpu,
            scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim, cp_group=cp_group,
        )
    raise ValueError(f"rope_type ({config.rope_type!r}) must be 'rope' or 'yarn'")


def rotary_angles(rotary: torch.nn.Module, seq_len: int, packed: bool, device: torch.device
                  ) -> tuple[torch.Tensor, float]:
    """``(angles [seq_len, 1, 1, rot_dim] on device, cosine/sine scale)`` from either rotary module."""
    out = rotary(seq_len, packed_seq=packed)
    angles, mscale = out if isinstance(out, tuple) else (out, 1.0)
    return (angles if angles.device == device else angles.to(device)), float(mscale)


def deinterleave_rope_channels(t: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """``t``'s first ``rot_dim`` channels reordered from pairs ``(x0, x1), (x2, x3), ...`` to
    ``(x0, x2, ..., x1, x3, ...)``; the remaining channels pass through."""
    head = t[..., :rot_dim]
    head = torch.cat((head[..., 0::2], head[..., 1::2]), dim=-1)
    if rot_dim == t.shape[-1]:
        return head
    return torch.cat((head, t[..., rot_dim:]), dim=-1)


def rotate_mla(t: torch.Tensor, angles: torch.Tensor, mscale: float, config: Any,
               cu_seqlens: torch.Tensor | None = None, cp_group: Any = None) -> torch.Tensor:
    """RoPE on MLA position channels ``t`` ``[s, b, heads, qk_pos_emb_head_dim]`` (or ``[t, 1, ...]`` packed)."""
    t = deinterleave_rope_channels(t, angles.shape[-1])
    return apply_rotary_pos_emb(t, angles, config=config, cu_seqlens=cu_seqlens, rotary_interleaved=False,
                                mscale=mscale, cp_group=cp_group)
