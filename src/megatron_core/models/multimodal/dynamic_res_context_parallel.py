"""Context parallelism for dynamic-resolution vision input (Megatron-Core 0.19's
``split_to_context_parallel_ranks_dynamic_res`` / ``gather_from_context_parallel_ranks_dynamic_res``, importable
from :mod:`megatron_core.models.multimodal.context_parallel`).

Dynamic-resolution images arrive packed: one row ``[1, total_patches, 3 * patch_dim**2]`` of pre-embedder patches,
``imgs_sizes`` ``[num_imgs, 2]`` (pixels) and ``cu_seqlens`` giving each image's patches. The split gives each CP
rank whole images (consecutive ones, the last rank taking the remainder); with fewer images than ranks, one-patch
dummy images fill the last ranks (``num_padded_ranks`` of them). With ``temporal_patch_size`` ``T > 1`` the entries
are video frames, ``num_frames`` says how many belong to each medium, and the split points land on medium or
tubelet (``T`` frames) boundaries so no rank holds part of a tubelet. With ``fp8_enabled`` each rank's patches are
padded with zeros to the FP8 GEMM multiple (16, 32 for ``'mxfp8'``) as one more pseudo-image.

The gather concatenates every rank's ``[n_r, ...]`` along dimension 0 in rank order, dropping the last
``num_padded_imgs`` ranks' parts (the dummies); its backward sums the gradient over the ranks and keeps this
rank's part, as Megatron-Core's all-to-all.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.fp8_utils import get_fp8_align_size
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["gather_from_context_parallel_ranks_dynamic_res", "split_to_context_parallel_ranks_dynamic_res"]

_DUMMY_SEQLEN = 1  # patches of a dummy image


def gather_from_context_parallel_ranks_dynamic_res(local_t: torch.Tensor, num_padded_imgs: int = 0,
                                                    cp_group: Any = None) -> torch.Tensor:
    """Every CP rank's ``local_t`` ``[n_r, ...]`` (``n_r`` may differ, the other dimensions may not) concatenated
    along dimension 0 in rank order, without the last ``num_padded_imgs`` ranks' parts."""
    group = resolve_process_group("cp", group=cp_group)
    cp_size = get_pg_size(group)
    if not 0 <= num_padded_imgs < cp_size:
        raise ValueError(f"num_padded_imgs ({num_padded_imgs}) must be >= 0 and below the CP size ({cp_size})")
    if cp_size == 1:
        return local_t
    shape = torch.tensor(local_t.shape, dtype=torch.int64, device=local_t.device)
    shapes = [torch.empty_like(shape) for _ in range(cp_size)]
    torch.distributed.all_gather(shapes, shape, group=group)
    shapes = [tuple(s.tolist()) for s in shapes]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(f"gather_from_context_parallel_ranks_dynamic_res: the ranks' tensors differ beyond "
                         f"dimension 0: {shapes}")
    sizes = [s[0] for s in shapes]
    gathered = gather_from_sequence_parallel_region(local_t, True, group=group, output_split_sizes=sizes)
    return gathered[:sum(sizes[:cp_size - num_padded_imgs])] if num_padded_imgs else gathered


def _tubelet_split_points(num_frames: list[int], tubelet: int, cp_size: int, total_frames: int) -> list[int]:
    """``cp_size + 1`` frame indices splitting the frames into near-equal shares on medium or tubelet boundaries."""
    bounds = [0]
    for frames in num_frames:
        bounds.append(bounds[-1] + frames)
    points = [0]
    for rank in range(1, cp_size):
        target = int(rank * (total_frames / cp_size))
        if target in bounds:
            point = target
        else:
            medium = min(max(bisect.bisect_right(bounds, target) - 1, 0), len(num_frames) - 1)
            start, end = bounds[medium], bounds[medium + 1]
            tubelets = math.ceil(num_frames[medium] / tubelet)
            if tubelets <= 1:  # one tubelet: the nearer end of the medium
                point = start if target - start < end - target else end
            else:
                index = min(max(round((target - start) / tubelet), 1), tubelets - 1)
                point = min(start + index * tubelet, end)
        points.append(max(point, points[-1]))
    points.append(total_frames)
    return points


def _frames_in_range(num_frames: list[int], lo: int, hi: int) -> list[int]:
    """Frames of each medium within frame range ``[lo, hi)`` (media with none left out)."""
    counts, start = [], 0
    for frames in num_frames:
        overlap = min(start + frames, hi) - max(start, lo)
        if overlap > 0:
            counts.append(overlap)
        start += frames
    return counts


def _tubelet_shares(num_frames: list[int], tubelet: int, cp_size: int, add_dummies: Any
                    ) -> tuple[list[int], int, list[int]]:
    """``(split points, dummies added, num_frames with dummies)``: dummies are added until no rank's share is
    empty."""
    dummies = max(0, cp_size - sum(math.ceil(f / tubelet) for f in num_frames))
    add_dummies(dummies)
    frames = num_frames + [1] * dummies
    for _ in range(cp_size + 1):
        points = _tubelet_split_points(frames, tubelet, cp_size, sum(frames))
        empty = sum(points[k] == points[k + 1] for k in range(cp_size))
        if empty == 0:
            return points, dummies, frames
        add_dummies(empty)
        dummies += empty
        frames = frames + [1] * empty
    raise RuntimeError(f"could not give each of {cp_size} CP ranks a non-empty share of the frames {num_frames}")


def split_to_context_parallel_ranks_dynamic_res(
    global_t: torch.Tensor,
    global_imgs_sizes: torch.Tensor,
    global_packed_seq_params: PackedSeqParams,
    *,
    patch_dim: int,
    fp8_enabled: bool = False,
    fp8_recipe: str | None = None,
    num_frames: Any = None,
    temporal_patch_size: int = 1,
    cp_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams, bool, int, torch.Tensor | None]:
    """This CP rank's share of packed dynamic-resolution patches (module docstring).

    ``global_t`` ``[1, total_patches, 3 * patch_dim**2]``, ``global_imgs_sizes`` ``[num_imgs, 2]``, and
    ``global_packed_seq_params.cu_seqlens_q`` the images' patch offsets. Returns ``(local_t, local_imgs_sizes,
    local_packed_seq_params (thd), has_padding (FP8 padding added), num_padded_ranks, local_num_frames (int32, or
    None without temporal_patch_size > 1))``.
    """
    group = resolve_process_group("cp", group=cp_group)
    cp_size, cp_rank = get_pg_size(group), get_pg_rank(group)
    hidden = 3 * patch_dim * patch_dim
    if global_t.dim() != 3 or global_t.shape[0] != 1 or global_t.shape[2] != hidden:
        raise ValueError(f"split_to_context_parallel_ranks_dynamic_res expects pre-embedder patches [1, patches, "
                         f"3*patch_dim*patch_dim={hidden}] (patch_dim={patch_dim}); got {tuple(global_t.shape)}")
    tubelets = temporal_patch_size > 1
    if tubelets and num_frames is None:
        raise ValueError(f"num_frames is required with temporal_patch_size={temporal_patch_size}")
    seqlens = (global_packed_seq_params.cu_seqlens_q[1:] - global_packed_seq_params.cu_seqlens_q[:-1]).tolist()
    if len(seqlens) != global_imgs_sizes.shape[0]:
        raise ValueError(f"cu_seqlens_q describes {len(seqlens)} images, global_imgs_sizes {global_imgs_sizes.shape[0]}")
    state = {"t": global_t, "sizes": global_imgs_sizes}

    def add_dummies(count: int) -> None:
        if count <= 0:
            return
        size = torch.tensor([[patch_dim, patch_dim]], dtype=global_imgs_sizes.dtype, device=global_imgs_sizes.device)
        state["sizes"] = torch.cat([state["sizes"], size.expand(count, 2)], dim=0)
        state["t"] = torch.cat([state["t"], global_t.new_zeros(1, count * _DUMMY_SEQLEN, hidden)], dim=1)
        seqlens.extend([_DUMMY_SEQLEN] * count)

    local_num_frames = None
    if tubelets:
        frames = [int(f) for f in (num_frames.tolist() if hasattr(num_frames, "tolist") else num_frames)]
        if sum(frames) != len(seqlens):
            raise ValueError(f"num_frames sums to {sum(frames)} frames, but there are {len(seqlens)} image entries")
        points, dummies, frames = _tubelet_shares(frames, temporal_patch_size, cp_size, add_dummies)
        real = len(seqlens) - dummies
        if dummies and real not in points:  # no rank mixes real frames and dummies
            k = next(k for k in range(cp_size) if points[k] < real < points[k + 1])
            points[k + 1] = real
        num_padded_ranks = 0
        while dummies and num_padded_ranks < cp_size and points[cp_size - 1 - num_padded_ranks] >= real:
            num_padded_ranks += 1
        lo, hi = points[cp_rank], points[cp_rank + 1]
        local_num_frames = torch.tensor(_frames_in_range(frames, lo, hi), dtype=torch.int32,
                                        device=global_imgs_sizes.device)
    else:
        num_padded_ranks = max(0, cp_size - len(seqlens))
        add_dummies(num_padded_ranks)
        per_rank = len(seqlens) // cp_size
        lo = cp_rank * per_rank
        hi = lo + per_rank if cp_rank < cp_size - 1 else len(seqlens)
    local_seqlens = seqlens[lo:hi]
    offset, length = sum(seqlens[:lo]), sum(local_seqlens)
    local_t = state["t"][:, offset:offset + length]
    local_sizes = state["sizes"][lo:hi]
    cu = [0]
    for n in local_seqlens:
        cu.append(cu[-1] + n)
    pad = -length % get_fp8_align_size(fp8_recipe) if fp8_enabled else 0
    if pad > 0:
        local_t = torch.cat([local_t, global_t.new_zeros(1, pad, hidden)], dim=1)
        cu.append(length + pad)
        pad_size = torch.tensor([[patch_dim, patch_dim * pad]], dtype=local_sizes.dtype, device=local_sizes.device)
        local_sizes = torch.cat([local_sizes, pad_size], dim=0)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=global_packed_seq_params.cu_seqlens_q.device)
    longest = max(local_seqlens, default=0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return local_t, local_sizes, params, pad > 0, num_padded_ranks, local_num_frames
