"""Pixel shuffle of vision tokens (Megatron-Core's ``llava_model.pixel_shuffle``, after InternVL).

Each ``f x f`` block of neighbouring patches (``f = 1 / scale_factor``) becomes one token whose features
are the block's patches concatenated (rows outer, columns inner), so a square grid of ``side**2``
tokens of width ``c`` becomes ``(side / f)**2`` tokens of width ``c * f**2``. ``version=2`` keeps the
blocks in row-major order, ``version=1`` in column-major order. With an explicit ``h`` x ``w`` grid
(non-square images) every ``f**2`` consecutive tokens are merged instead, as Megatron-Core does.
"""

from __future__ import annotations

import math

import torch

__all__ = ["pixel_shuffle"]


def pixel_shuffle(x: torch.Tensor, scale_factor: float = 0.5, version: int = 2, h: int | None = None,
                  w: int | None = None) -> torch.Tensor:
    """Merge ``f x f`` patch blocks of ``x`` ``[n, tokens, c]`` into ``[n, tokens / f**2, c * f**2]``."""
    factor = round(1 / scale_factor)
    if factor < 1 or not math.isclose(factor * scale_factor, 1.0):
        raise ValueError(f"pixel_shuffle: 1 / scale_factor ({scale_factor}) must be a positive integer")
    if x.dim() != 3:
        raise ValueError(f"pixel_shuffle expects [num_tiles, tokens, hidden], got shape {tuple(x.shape)}")
    n, tokens, c = x.shape
    block = factor * factor
    if h is not None or w is not None:
        if h is None or w is None or h * w != tokens or tokens % block:
            raise ValueError(f"pixel_shuffle: h ({h}) and w ({w}) must both be given, with h*w equal to the "
                             f"{tokens} tokens and a multiple of {block}")
        return x.reshape(n, tokens // block, c * block)
    side = math.isqrt(tokens)
    if side * side != tokens or side % factor:
        raise ValueError(f"pixel_shuffle: {tokens} tokens are not a square grid whose side is a multiple of "
                         f"{factor}; pass h and w for other grids")
    if version not in (1, 2):
        raise ValueError(f"pixel_shuffle: version ({version}) must be 1 or 2")
    cells = side // factor
    x = x.reshape(n, cells, factor, cells, factor, c)  # [n, block row, row in block, block col, col in block, c]
    order = (0, 1, 3, 2, 4, 5) if version == 2 else (0, 3, 1, 2, 4, 5)
    return x.permute(order).reshape(n, cells * cells, block * c)
