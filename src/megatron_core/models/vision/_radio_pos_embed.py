"""RADIO's conditional position embeddings (CPE): one learned grid resampled to each image's patch grid.

The grid ``[1, h, R, C]`` holds embeddings for the largest image (``R x C`` patches). For an image of
``rows x cols`` patches, in the order Megatron-Core's ``RADIOViTModel`` applies them:

- ``interpolate_only_cpe``: bilinear resize of the whole grid (after an aspect-ratio crop, if asked);
- CPE in training (``random_crop``): for each sample a random window of the grid, of scale ``s`` in
  ``[sqrt(0.1), 1]`` and aspect ``a`` with ``log a`` in ``[log 3/4, log 4/3]`` (width ``s*a``, height ``s/a``,
  clamped to 1) at a random offset, sampled bilinearly on a ``rows x cols`` lattice (``grid_sample``,
  zero padding) -- a train-time augmentation;
- CPE in eval: resize the grid to ``max(rows, cols)`` squared and keep the top-left ``rows x cols``; or,
  with ``cpe_aspect_ratio_select`` (or when that square would overflow int32 indexing), crop the grid to the
  image's aspect ratio and resize to ``rows x cols``;
- no CPE: crop the top-left ``rows x cols`` (or the aspect-ratio crop);

and whatever comes out is resized to ``rows x cols`` if it is not that size yet. The random draws use the
global generator in Megatron-Core's order (scale, aspect, offset), so a seeded run repeats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PosEmbedOptions", "resample_pos_embed"]


@dataclass(frozen=True)
class PosEmbedOptions:
    """How :func:`resample_pos_embed` maps the grid (``RADIOViTModel``'s CPE switches)."""

    has_cpe: bool = True
    interpolate_only_cpe: bool = False
    cpe_aspect_ratio_select: bool = False
    random_crop: bool = False
    interpolate_align_corners: bool = False
    grid_sample_align_corners: bool = True


def _resize(grid: torch.Tensor, size: tuple[int, int], align_corners: bool) -> torch.Tensor:
    """Bilinear resize in fp32, back in the grid's dtype."""
    return F.interpolate(grid.float(), size=size, mode="bilinear", align_corners=align_corners).to(grid.dtype)


def _window(grid: torch.Tensor, dims: tuple[int, int]) -> torch.Tensor:
    """The top-left ``dims`` of ``grid`` (a side already shorter is kept whole)."""
    return grid[..., : dims[0], : dims[1]]


def _aspect_crop(grid: torch.Tensor, dims: tuple[int, int]) -> torch.Tensor:
    """The top-left part of ``grid`` with the image's aspect ratio (the longer side kept whole)."""
    grid_h, grid_w = grid.shape[-2:]
    rows, cols = dims
    if rows == cols:
        return grid
    if cols < rows:
        return grid[..., :, : min(grid_w, math.ceil(grid_w * (cols / rows)))]
    return grid[..., : min(grid_h, math.ceil(grid_h * (rows / cols))), :]


def _random_crop(grid: torch.Tensor, dims: tuple[int, int], batch_size: int, align_corners: bool) -> torch.Tensor:
    """One random window of ``grid`` per sample, sampled on a ``dims`` lattice: ``[batch_size, h, rows, cols]``."""
    device = grid.device
    min_scale = math.sqrt(0.1)
    scale = torch.rand(batch_size, 1, 1, device=device) * (1 - min_scale) + min_scale
    aspect_min = math.log(3 / 4)
    aspect_max = -aspect_min
    aspect = torch.exp(torch.rand(batch_size, 1, 1, device=device) * (aspect_max - aspect_min) + aspect_min)
    scale_xy = torch.stack([scale * aspect, scale * (1 / aspect)], dim=-1).clamp_(0, 1)  # [b, 1, 1, 2]
    offset_xy = torch.rand(batch_size, 1, 1, 2, device=device) * (1 - scale_xy)
    rows, cols = dims
    lin_x = torch.linspace(0, 1, steps=cols, device=device)[None, None].expand(batch_size, rows, -1)
    lin_y = torch.linspace(0, 1, steps=rows, device=device)[None, :, None].expand(batch_size, -1, cols)
    points = torch.stack([lin_x, lin_y], dim=-1) * scale_xy + offset_xy  # [b, rows, cols, 2] in [0, 1]
    return F.grid_sample(grid.float().expand(batch_size, -1, -1, -1), points * 2 - 1, mode="bilinear",
                         padding_mode="zeros", align_corners=align_corners).to(grid.dtype)


def resample_pos_embed(grid: torch.Tensor, dims: tuple[int, int], batch_size: int,
                       options: PosEmbedOptions) -> torch.Tensor:
    """Position embeddings ``[1 or batch_size, rows*cols, h]`` from ``grid`` ``[1, h, R, C]`` for ``dims``."""
    align = options.interpolate_align_corners
    if options.interpolate_only_cpe:
        if options.cpe_aspect_ratio_select:
            grid = _aspect_crop(grid, dims)
        grid = _resize(grid, dims, align)
    elif options.has_cpe and options.random_crop:
        grid = _random_crop(grid, dims, batch_size, options.grid_sample_align_corners)
    elif options.has_cpe:
        side = max(dims)
        channels = grid.shape[0] * grid.shape[1]
        too_large = channels * side**2 >= torch.iinfo(torch.int32).max
        if too_large or options.cpe_aspect_ratio_select:
            grid = _resize(_aspect_crop(grid, dims), dims, align)
        else:
            grid = _window(_resize(grid, (side, side), align), dims)
    elif options.cpe_aspect_ratio_select:
        grid = _aspect_crop(grid, dims)
    else:
        grid = _window(grid, dims)
    if tuple(grid.shape[-2:]) != tuple(dims):
        grid = _resize(grid, dims, align)
    return grid.flatten(2).transpose(1, 2)
