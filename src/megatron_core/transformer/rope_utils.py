"""Rotary position embedding math (Megatron-Core's ``apply_rotary_pos_emb``).

``freqs`` is ``[s, 1, 1, rot_dim]`` as produced by ``RotaryEmbedding``: the angles for each
position, laid out as ``[f0..f_{d/2-1}, f0..f_{d/2-1}]`` (half-split, as in Hugging Face Llama)
or, with ``rotary_interleaved``, ``[f0, f0, f1, f1, ...]`` (pairs of adjacent channels rotate
together, as in GPT-J). Only the first ``rot_dim`` channels rotate (``rotary_percent < 1``);
the rest pass through.

Outside ``torch.compile`` the rotation is one fused function each way (``jit_fuser``: compiled on
accelerators) with a hand-written backward, ``grad * cos - R(grad * sin)`` (``R``, the rotate-half map,
has ``R^T = -R``), that saves only the cosines and sines; the cosines and sines are computed once per
angle tensor and reused by every layer of the forward. Under ``torch.compile`` the same expression
is traced as is (the compiler fuses it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_core.jit import jit_fuser


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``scale``: ``0.1 * mscale * ln(scale) + 1`` (1 at
    ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration_factor(config: object) -> float:
    """The factor YaRN multiplies the cosines and sines by (its "attention factor"), from ``config``'s ``yarn_*``.

    ``yarn_mscale(f, yarn_mscale) / yarn_mscale(f, yarn_mscale_all_dim)`` with ``f = yarn_rotary_scaling_factor``
    (``yarn_mscale(f)`` alone when either is None); 1.0 for a config without YaRN fields or with ``f <= 1``.
    """
    factor = getattr(config, "yarn_rotary_scaling_factor", None)
    if factor is None:
        return 1.0
    return yarn_concentration(factor, getattr(config, "yarn_mscale", None), getattr(config, "yarn_mscale_all_dim", None))


def yarn_concentration(scaling_factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """``yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim)``, or ``yarn_mscale(f)`` when either is None."""
    if mscale is None or mscale_all_dim is None:
        return yarn_mscale(scaling_factor)
    return float(yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim))


def apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, config: object = None, cu_seqlens: torch.Tensor | None = None,
    rotary_interleaved: bool | None = None, mscale: float | None = None, cp_group: Any = None,
) -> torch.Tensor:
    """Rotate ``t`` ``[s, b, heads, dim]`` by the angles ``freqs`` ``[s, 1, 1, rot_dim]``.

    ``rotary_interleaved`` defaults to ``config.rotary_interleaved``. With ``cu_seqlens`` (a packed
    sequence, padded offsets) each token uses its position inside its document; ``freqs`` must
    then cover the longest document (not CP-split), and under context parallelism ``cp_group``
    says which per-document chunks this rank holds. The cosines and sines are scaled by ``mscale``,
    by default YaRN's :func:`yarn_concentration_factor` of ``config`` (1.0 without YaRN), as Megatron-Core's
    attention passes it.
    """
    if rotary_interleaved is None:
        rotary_interleaved = bool(getattr(config, "rotary_interleaved", False))
    if mscale is None:
        mscale = yarn_concentration_factor(config)
    seq_len = t.shape[0]
    cos, sin = rotary_cos_sin(freqs, seq_len, t.dtype, mscale, cu_seqlens=cu_seqlens, cp_group=cp_group)
    return rotate(t, cos, sin, rotary_interleaved, traced=_traced(freqs))


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_interleaved: bool,
           traced: bool | None = None) -> torch.Tensor:
    """``t * cos + R(t) * sin`` on ``t``'s first ``cos.shape[-1]`` channels (the rest pass through).

    ``cos`` and ``sin`` broadcast against ``t`` (``[s, 1, 1, rot_dim]`` for ``t`` ``[s, b, heads, dim]``) and hold
    the full rotary width: each angle twice, in the half-split or (``rotary_interleaved``) pairwise layout.
    ``traced`` (default: under ``torch.compile`` or when ``cos`` / ``sin`` need gradients) runs the plain
    expression instead of the function with the hand-written backward.
    """
    if traced is None:
        traced = torch.compiler.is_compiling() or cos.requires_grad or sin.requires_grad
    if traced:
        return _rotate(t, cos, sin, rotary_interleaved)
    return _FusedRotation.apply(t, cos, sin, rotary_interleaved)


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """The part of ``pos_emb`` that context-parallel rank ``r`` of ``cp_group`` (size ``cp``) holds along ``seq_dim``.

    The sequence is cut into ``2 * cp`` equal chunks and rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``
    (the load-balanced split of causal attention), concatenated in that order.
    """
    if cp_group is None:
        raise ValueError("get_pos_emb_on_this_cp_rank needs a cp_group (the context-parallel process group)")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    seq_dim = seq_dim % pos_emb.dim()
    seq_len = pos_emb.shape[seq_dim]
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length ({seq_len}) must be divisible by 2 * context_parallel_size ({2 * cp_size})"
        )
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, seq_len // (2 * cp_size),
                          *pos_emb.shape[seq_dim + 1:])
    index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=pos_emb.device)
    kept = chunks.index_select(seq_dim, index)
    return kept.reshape(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 1:])


def rotary_cos_sin(
    freqs: torch.Tensor, seq_len: int, dtype: torch.dtype, mscale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None, cp_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosine and sine tables ``[seq_len, 1, 1, rot_dim]`` (in ``dtype``) that rotating by ``freqs`` uses.

    Row ``i`` rotates the sequence's position ``i``; with ``cu_seqlens`` (a packed sequence) it holds token
    ``i``'s angles, from its position inside its document (see :func:`apply_rotary_pos_emb`). Outside
    ``torch.compile`` the plain tables are computed once per angle tensor (every layer of a forward shares them).
    """
    if cu_seqlens is not None:
        from megatron_core.transformer.packed_sequences import thd_positions_from_cu

        cp_size = cp_group.size() if cp_group is not None else 1
        cp_rank = cp_group.rank() if cp_group is not None else 0
        positions = thd_positions_from_cu(cu_seqlens, seq_len, cp_size, cp_rank, freqs.device)
        return _scaled_cos_sin(freqs[positions], mscale, dtype)
    if _traced(freqs):
        return _scaled_cos_sin(freqs[:seq_len], mscale, dtype)
    return _cached_cos_sin(freqs, seq_len, mscale, dtype)


def _traced(freqs: torch.Tensor) -> bool:
    """Whether the rotation runs as the plain expression: inside ``torch.compile``, or with angles that learn."""
    return torch.compiler.is_compiling() or freqs.requires_grad


def _scaled_cos_sin(angles: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype)


_COS_SIN_CACHE: list[tuple[torch.Tensor, tuple, torch.Tensor, torch.Tensor]] = []


def _cached_cos_sin(freqs: torch.Tensor, seq_len: int, mscale: float, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_scaled_cos_sin` of ``freqs[:seq_len]``, kept for the last angle tensor seen.

    The model builds one angle tensor per forward and every layer rotates with it: the cosines and sines
    are computed once. The cache holds a reference to that tensor, so its identity cannot be reused, and
    its version counter, so an in-place change is noticed.
    """
    if freqs.is_inference():  # made under inference_mode: no version counter to notice a change, so not cached
        with torch.no_grad():
            return _scaled_cos_sin(freqs[:seq_len], mscale, dtype)
    key = (seq_len, mscale, dtype, freqs._version)
    entry = _COS_SIN_CACHE[0] if _COS_SIN_CACHE else None  # read once: another thread may replace it
    if entry is not None and entry[0] is freqs and entry[1] == key:
        return entry[2], entry[3]
    with torch.no_grad():
        cos, sin = _scaled_cos_sin(freqs[:seq_len], mscale, dtype)
    _COS_SIN_CACHE[:] = [(freqs, key, cos, sin)]
    return cos, sin


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``t * cos + R(t) * sin`` on the first ``cos.shape[-1]`` channels; the rest pass through."""
    rot_dim = cos.shape[-1]
    if rot_dim == t.shape[-1]:
        return t * cos + _rotate_half(t, interleaved) * sin
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((t_rot * cos + _rotate_half(t_rot, interleaved) * sin, t_pass), dim=-1)


@jit_fuser
def _rotate_forward(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate(t, cos, sin, interleaved)


@jit_fuser
def _rotate_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The adjoint of :func:`_rotate`: ``grad * cos + R^T(grad * sin)`` with ``R^T = -R``."""
    rot_dim = cos.shape[-1]
    if rot_dim == grad.shape[-1]:
        return grad * cos - _rotate_half(grad * sin, interleaved)
    g_rot, g_pass = grad[..., :rot_dim], grad[..., rot_dim:]
    return torch.cat((g_rot * cos - _rotate_half(g_rot * sin, interleaved), g_pass), dim=-1)


class _FusedRotation(torch.autograd.Function):
    """The rotation with a backward that keeps only ``cos`` and ``sin`` (not the rotated tensor)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate_forward(t, cos, sin, interleaved)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_backward(grad, cos, sin, ctx.interleaved), None, None, None
