"""Rotate a step's queries and keys and write keys and values into their cache slots: one Triton kernel.

A decode step of the dynamic context otherwise spends three small kernels per layer before attention
(rotate the queries, rotate the keys and write them to the cache, write the values), each costing
about as much to launch as to run. :func:`rope_cache_append` reads ``linear_qkv``'s output in its
per-group layout (``[T, groups, (heads_per_group + 2) * head_dim]``: the group's query heads, then its
key, then its value), rotates query and key heads at each token's position, writes the rotated key and
the value to slot ``slot_mapping[t]`` of the caches, and returns the rotated queries ``[T, heads,
head_dim]``. One program per (token, group).

The arithmetic is :func:`megatron_core.inference.contexts.rotary.rotate_at_positions`' inside a
compiled graph (cosines and sines of the fp32 angles rounded to the activations' dtype, products in
fp32, one rounding). :func:`rope_cache_append_reference` is the same step in plain PyTorch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules

__all__ = ["rope_cache_append", "rope_cache_append_reference", "rope_cache_append_supported"]


def rope_cache_append_supported(mixed_qkv: torch.Tensor, angles: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`rope_cache_append` can run: CUDA, fp16/bf16 activations and cache, fp32 angles, Triton."""
    head_dim = k_cache.shape[-1]
    return (mixed_qkv.is_cuda and k_cache.is_cuda and angles.is_cuda
            and mixed_qkv.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == mixed_qkv.dtype
            and angles.dtype == torch.float32 and angles.shape[-1] <= head_dim and head_dim & (head_dim - 1) == 0
            and have_triton())


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def rope_cache_append_kernel(
        qkv_ptr, angles_ptr, pos_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        stride_xt, stride_xg, stride_a, stride_qt, stride_qh, stride_kc, stride_kg, stride_vc, stride_vg,
        HEADS_PER_GROUP: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        t = tl.program_id(0)
        group = tl.program_id(1)
        heads = tl.arange(0, HEADS_PAD)  # query heads, then the key (HEADS_PER_GROUP), then the value
        d = tl.arange(0, HEAD_DIM)
        head_ok = heads < HEADS_PER_GROUP + 2
        base = qkv_ptr + t * stride_xt + group * stride_xg + heads[:, None] * HEAD_DIM
        # Independent loads first: the angle's address waits for the position.
        x = tl.load(base + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if INTERLEAVED:  # rotate_half pairs (2i, 2i + 1): -x[2i + 1], x[2i]
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:  # halves: -x[d + rot / 2], x[d - rot / 2]
            partner = tl.where(d < ROT_DIM // 2, d + ROT_DIM // 2, d - ROT_DIM // 2)
            sign = tl.where(d < ROT_DIM // 2, -1.0, 1.0)
        rotating = d < ROT_DIM
        partner = tl.where(rotating, partner, d)
        x_partner = tl.load(base + partner[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
        angle = tl.load(angles_ptr + pos * stride_a + d, mask=rotating, other=0.0)
        dtype = q_ptr.dtype.element_ty
        cos = tl.cos(angle).to(dtype).to(tl.float32)
        sin = tl.sin(angle).to(dtype).to(tl.float32)
        rotated = x * cos[None, :] + sign[None, :] * x_partner * sin[None, :]
        out = tl.where(rotating[None, :] & (heads[:, None] <= HEADS_PER_GROUP), rotated, x).to(dtype)
        is_query = heads < HEADS_PER_GROUP
        tl.store(q_ptr + t * stride_qt + (group * HEADS_PER_GROUP + heads[:, None]) * stride_qh + d[None, :], out,
                 mask=is_query[:, None])
        # The key row and the value row of the tile go to the caches (each row's offset is zero elsewhere).
        is_key = heads == HEADS_PER_GROUP
        is_value = heads == HEADS_PER_GROUP + 1
        tl.store(k_cache_ptr + slot * stride_kc + group * stride_kg + d[None, :] + heads[:, None] * 0, out,
                 mask=is_key[:, None])
        tl.store(v_cache_ptr + slot * stride_vc + group * stride_vg + d[None, :] + heads[:, None] * 0, out,
                 mask=is_value[:, None])

    return rope_cache_append_kernel


def _grouped(mixed_qkv: torch.Tensor, groups: int) -> torch.Tensor:
    """``[T, 1, groups * per_group]`` (or ``[T, ...]``) -> ``[T, groups, per_group]`` (a view)."""
    return mixed_qkv.reshape(mixed_qkv.shape[0], groups, -1)


def _rope_cache_append(mixed_qkv: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                       interleaved: bool) -> torch.Tensor:
    groups, head_dim = k_cache.shape[1], k_cache.shape[2]
    heads_per_group = heads // groups
    qkv = _grouped(mixed_qkv, groups)
    if qkv.shape[2] != (heads_per_group + 2) * head_dim or qkv.stride(2) != 1:
        raise ValueError(f"rope_cache_append: linear_qkv output {tuple(mixed_qkv.shape)} does not hold {heads} "
                         f"query heads and {groups} key/value groups of {head_dim}")
    tokens = qkv.shape[0]
    angles = angles.reshape(angles.shape[0], angles.shape[-1])
    query = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _kernel()[(tokens, groups)](
        qkv, angles, positions, slot_mapping, query, k_cache, v_cache,
        qkv.stride(0), qkv.stride(1), angles.stride(0), query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEADS_PER_GROUP=heads_per_group, HEADS_PAD=1 << (heads_per_group + 1).bit_length(), HEAD_DIM=head_dim,
        ROT_DIM=angles.shape[-1], INTERLEAVED=interleaved,
    )
    return query


@torch.library.custom_op("megatron_core::rope_cache_append", mutates_args=("k_cache", "v_cache"))
def _rope_cache_append_op(mixed_qkv: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                          interleaved: bool) -> torch.Tensor:
    return _rope_cache_append(mixed_qkv, angles, positions, slot_mapping, k_cache, v_cache, heads, interleaved)


@_rope_cache_append_op.register_fake
def _rope_cache_append_fake(mixed_qkv: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor,
                            slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                            interleaved: bool) -> torch.Tensor:
    return mixed_qkv.new_empty(mixed_qkv.shape[0], heads, k_cache.shape[2])


def rope_cache_append(mixed_qkv: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                      interleaved: bool = False) -> torch.Tensor:
    """Rotated queries ``[T, heads, head_dim]``; rotated keys and the values are written to the caches.

    ``mixed_qkv``: ``linear_qkv``'s output for ``T`` tokens (per-group layout, see the module doc);
    ``angles``: the rotary table ``[max_seq, ..., rot_dim]`` (fp32; ``rot_dim <= head_dim``);
    ``positions``/``slot_mapping`` ``[T]``; ``k_cache``/``v_cache`` ``[slots, groups, head_dim]``.
    Check :func:`rope_cache_append_supported` first.
    """
    if torch.compiler.is_compiling():
        return torch.ops.megatron_core.rope_cache_append(mixed_qkv, angles, positions, slot_mapping, k_cache,
                                                         v_cache, heads, interleaved)
    return _rope_cache_append(mixed_qkv, angles, positions, slot_mapping, k_cache, v_cache, heads, interleaved)


def rope_cache_append_reference(mixed_qkv: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor,
                                slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                                interleaved: bool = False) -> torch.Tensor:
    """The same step in plain PyTorch (split, rotate as a compiled decode graph does, ``index_copy_``; for tests)."""
    from megatron_core.transformer.rope_utils import _rotate_half

    groups, head_dim = k_cache.shape[1], k_cache.shape[2]
    per_group = heads // groups
    qkv = _grouped(mixed_qkv, groups)
    tokens = qkv.shape[0]
    query, key, value = torch.split(qkv.view(tokens, groups, per_group + 2, head_dim), [per_group, 1, 1], dim=2)
    rot = angles.shape[-1]
    rows = angles.reshape(angles.shape[0], rot)[positions][:, None, None, :]
    cos, sin = rows.cos().to(qkv.dtype).float(), rows.sin().to(qkv.dtype).float()

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        turned = t[..., :rot] * cos + _rotate_half(t[..., :rot], interleaved) * sin
        return torch.cat((turned, t[..., rot:]), dim=-1).to(qkv.dtype)

    k_cache.index_copy_(0, slot_mapping, rotate(key)[:, :, 0])
    v_cache.index_copy_(0, slot_mapping, value[:, :, 0])
    return rotate(query).reshape(tokens, heads, head_dim)
