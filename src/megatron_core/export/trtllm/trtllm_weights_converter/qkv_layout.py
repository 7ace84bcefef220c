"""Megatron's fused QKV layout -> TensorRT-LLM's, per inference tensor-parallel rank.

Megatron stores ``linear_qkv`` output features grouped by query group: for each of the ``num_kv_heads``
groups, its ``q_per_group`` query heads, then its key head, then its value head (``head_dim`` features each).
TensorRT-LLM wants, on each TP rank, all of that rank's query heads, then its key heads, then its value heads.
Groups are split contiguously over the ranks; with fewer groups than ranks each key/value head is repeated
so every rank gets one (``tp_size`` must then be a multiple of ``num_kv_heads``).
"""

from __future__ import annotations

import torch


def check_kv_heads_split(num_kv_heads: int, tp_size: int) -> None:
    """Raise ``ValueError`` unless ``num_kv_heads`` query groups can be split or repeated over ``tp_size`` ranks."""
    if num_kv_heads % tp_size != 0 and tp_size % num_kv_heads != 0:
        raise ValueError(
            f"the number of query groups ({num_kv_heads}) and the inference tensor-parallel size ({tp_size}) "
            "must divide one another (groups split over the ranks, or repeated on them)"
        )


def split_qkv_for_trtllm(
    qkv: torch.Tensor, num_attention_heads: int, num_kv_heads: int, tp_size: int
) -> list[torch.Tensor]:
    """Per-rank ``[q | k | v]`` pieces of ``qkv``, whose last dim is Megatron's grouped QKV features.

    ``qkv`` is ``[..., num_kv_heads * (q_per_group + 2) * head_dim]`` (a weight as ``[in, out]`` or a bias);
    each returned piece is ``[..., (q_per_rank + 2 * kv_per_rank) * head_dim]``.
    """
    check_kv_heads_split(num_kv_heads, tp_size)
    q_per_group = num_attention_heads // num_kv_heads
    lead = qkv.shape[:-1]
    grouped = qkv.reshape(*lead, num_kv_heads, q_per_group + 2, -1)
    q, k, v = torch.split(grouped, [q_per_group, 1, 1], dim=-2)
    if num_kv_heads < tp_size:
        repeat = tp_size // num_kv_heads
        k = k.expand(*lead, num_kv_heads, repeat, k.shape[-1])
        v = v.expand(*lead, num_kv_heads, repeat, v.shape[-1])
    pieces = [t.reshape(*lead, -1).chunk(tp_size, dim=-1) for t in (q, k, v)]
    return [torch.cat([q_r, k_r, v_r], dim=-1) for q_r, k_r, v_r in zip(*pieces)]
