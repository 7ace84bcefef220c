"""RADIO's video tubelets (temporal compression, ``temporal_patch_dim = T > 1``), as Megatron-Core 0.19 does them.

Input is RADIO's dynamic-resolution packing: ``[1, sum(patches_f), 3*P*P]`` over every frame ``f`` of every
media item, ``imgs_sizes`` one ``(H, W)`` per frame and ``num_frames`` frames per item. A video of ``nf``
frames (all of one size) is padded to a multiple of ``T`` by repeating its last frame and every ``T``
consecutive frames become one tubelet: the frames' patch features concatenated, ``[1, patches, T*3*P*P]``.
A single image (``nf == 1``) is one tubelet of itself, its features repeated ``T`` times -- or, with a separate
video embedder, left at ``3*P*P`` for the image embedder.

The load hooks turn a checkpoint of an image-only embedder (``3*P*P`` inputs) into the tubelet embedder(s):
the weight repeated ``T`` times and divided by ``T``, so a tubelet of ``T`` equal frames embeds as the frame.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from megatron_core.packed_seq_params import PackedSeqParams

__all__ = ["GroupedFrames", "group_frames", "init_embedder_from_2d", "init_video_embedder"]

_logger = logging.getLogger(__name__)

GroupedFrames = tuple[Any, list[tuple[int, int]], list[int], PackedSeqParams | None, list[bool]]


def group_frames(x: torch.Tensor, sizes: list[tuple[int, int]], num_frames: list[int], temporal_patch_dim: int,
                 patch_dim: int, packed_seq_params: PackedSeqParams | None,
                 skip_image_duplication: bool) -> GroupedFrames:
    """``(tubelets, their sizes, tubelets per item, packed params for the tubelets or None, is_image per tubelet)``.

    ``tubelets`` is ``[1, sum(patches_t), T*3*P*P]``, or, with ``skip_image_duplication``, a list of per-tubelet
    tensors (images ``3*P*P`` wide, videos ``T*3*P*P``).
    """
    t = temporal_patch_dim
    if sum(num_frames) != len(sizes):
        raise ValueError(f"imgs_sizes must have one entry per frame: got {len(sizes)} entries but "
                         f"sum(num_frames) = {sum(num_frames)} (num_frames={list(num_frames)})")
    chunks = torch.split(x, [(h // patch_dim) * (w // patch_dim) for h, w in sizes], dim=1)
    tubelets, new_sizes, new_num_frames, is_image = [], [], [], []
    first = 0
    for nf in num_frames:
        if nf == 1:
            chunk = chunks[first]
            tubelets.append(chunk if skip_image_duplication else chunk.repeat(1, 1, t))
            new_sizes.append(sizes[first])
            new_num_frames.append(1)
            is_image.append(True)
        else:
            if len(set(sizes[first:first + nf])) != 1:
                raise ValueError(f"the frames of one video must have one size, got {sizes[first:first + nf]}")
            groups = math.ceil(nf / t)
            for g in range(groups):
                frames = [chunks[first + min(g * t + k, nf - 1)] for k in range(t)]  # the last frame repeats
                tubelets.append(torch.cat(frames, dim=-1))
                new_sizes.append(sizes[first])
                is_image.append(False)
            new_num_frames.append(groups)
        first += nf
    grouped = tubelets if skip_image_duplication else torch.cat(tubelets, dim=1)
    new_params = None
    if packed_seq_params is not None:
        lengths = [(h // patch_dim) * (w // patch_dim) for h, w in new_sizes]
        cu = packed_seq_params.cu_seqlens_q
        bounds = torch.tensor([0, *lengths], dtype=cu.dtype, device=cu.device).cumsum(0).to(cu.dtype)
        longest = max(lengths) if lengths else 0
        new_params = PackedSeqParams(qkv_format=packed_seq_params.qkv_format, cu_seqlens_q=bounds,
                                     cu_seqlens_kv=bounds, max_seqlen_q=longest, max_seqlen_kv=longest)
    return grouped, new_sizes, new_num_frames, new_params, is_image


def init_embedder_from_2d(state_dict: dict, prefix: str, temporal_patch_dim: int, patch_dim: int) -> None:
    """Load pre-hook body: an image-only ``embedder.weight`` ``[h, 3*P*P]`` becomes ``[h, T*3*P*P]`` (repeat / T)."""
    key = prefix + "embedder.weight"
    weight = state_dict.get(key)
    if weight is not None and weight.shape[1] == 3 * patch_dim * patch_dim:
        state_dict[key] = weight.repeat(1, temporal_patch_dim) / temporal_patch_dim
        _logger.info("RADIO: embedder weight %s widened to %s for temporal_patch_dim=%d", tuple(weight.shape),
                     tuple(state_dict[key].shape), temporal_patch_dim)


def init_video_embedder(state_dict: dict, prefix: str, temporal_patch_dim: int, patch_dim: int) -> None:
    """Load pre-hook body for a separate video embedder missing from the checkpoint.

    From an image-only embedder: the video weight is it repeated / T. From a combined tubelet embedder
    ``[h, T*3*P*P]``: that becomes the video weight and the image weight is its mean over the T frames.
    The video bias copies the image bias.
    """
    image_key, video_key = prefix + "embedder.weight", prefix + "video_embedder.weight"
    weight = state_dict.get(image_key)
    if weight is None:
        return
    t, width = temporal_patch_dim, 3 * patch_dim * patch_dim
    if video_key not in state_dict:
        if weight.shape[1] == width:
            state_dict[video_key] = weight.repeat(1, t) / t
        elif weight.shape[1] == t * width:
            state_dict[video_key] = weight.clone()
            state_dict[image_key] = weight.view(weight.shape[0], t, -1).mean(dim=1)
    image_bias, video_bias = prefix + "embedder.bias", prefix + "video_embedder.bias"
    if image_bias in state_dict and video_bias not in state_dict:
        state_dict[video_bias] = state_dict[image_bias].clone()
