"""Rotary embedding at per-token positions (helper of the inference contexts).

``GPTModel`` builds the angles for positions ``0 .. max_sequence_length - 1`` when it runs with an
inference context; a context picks the rows of its tokens' positions, so each request is rotated
at its own offset even when many requests share one flattened step.

Decode steps are made of many small kernels, so the cosines and sines of the angle table are
computed once per table (and dtype), not in every layer of every step: each layer gathers its rows
and rotates query and key in one fused element-wise function (compiled on accelerators through
:func:`megatron_core.jit.jit_fuser`). The arithmetic is the one of
:func:`megatron_core.transformer.rope_utils.apply_rotary_pos_emb` (angles in fp32, cosines and sines
rounded to the activations' dtype).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from megatron_core import device
from megatron_core.jit import jit_fuser
from megatron_core.transformer.rope_utils import _rotate_half

# id(angle table) -> (weak reference to it, dtype, cos table, sin table); a few entries per model.
_TABLES: dict[int, tuple[weakref.ref, torch.dtype, torch.Tensor, torch.Tensor]] = {}


def _cos_sin(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of an angle table, in ``dtype``, computed once per (table, dtype)."""
    entry = _TABLES.get(id(angles))
    fresh = entry is None or entry[0]() is not angles or entry[1] != dtype
    if fresh and device.is_capturing(angles):
        # First seen while a CUDA graph is captured (its kernels only run at replay): compute in place,
        # cache nothing.
        return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    if fresh:
        for key in [k for k, v in _TABLES.items() if v[0]() is None]:
            del _TABLES[key]  # tables of models that are gone
        entry = (weakref.ref(angles), dtype, torch.cos(angles).to(dtype), torch.sin(angles).to(dtype))
        _TABLES[id(angles)] = entry
    return entry[2], entry[3]


@jit_fuser
def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    if rot_dim == t.shape[-1]:
        return t * cos + _rotate_half(t, interleaved) * sin
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((t_rot * cos + _rotate_half(t_rot, interleaved) * sin, t_pass), dim=-1)


def _rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[max_seq, 1, 1, d]`` table at ``positions`` ``[s]`` (-> ``[s, 1, 1, d]``) or ``[s, b]``
    (-> ``[s, b, 1, d]``)."""
    return table[positions] if positions.dim() == 1 else table[positions, 0]


def rotate_at_positions(
    query: torch.Tensor, key: torch.Tensor, rotary_pos_emb: Any, positions: torch.Tensor, config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query``/``key`` ``[s, b, heads, hn]`` by the angles of ``positions`` ``[s]`` or ``[s, b]``."""
    if rotary_pos_emb is None:
        return query, key
    q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    if torch.compiler.is_compiling():
        # Inside a compiled graph (no table cache: ids of traced tensors mean nothing): the cosines and
        # sines of just the step's rows, which the compiler fuses with the rotation.
        q_rows = _rows(q_emb, positions)
        k_rows = q_rows if k_emb is q_emb else _rows(k_emb, positions)
        return (_rotate(query, q_rows.cos().to(query.dtype), q_rows.sin().to(query.dtype), interleaved),
                _rotate(key, k_rows.cos().to(key.dtype), k_rows.sin().to(key.dtype), interleaved))
    q_cos, q_sin = _cos_sin(q_emb, query.dtype)
    q_cos, q_sin = _rows(q_cos, positions), _rows(q_sin, positions)
    if k_emb is q_emb and key.dtype == query.dtype:
        k_cos, k_sin = q_cos, q_sin
    else:
        k_cos, k_sin = _cos_sin(k_emb, key.dtype)
        k_cos, k_sin = _rows(k_cos, positions), _rows(k_sin, positions)
    return _rotate(query, q_cos, q_sin, interleaved), _rotate(key, k_cos, k_sin, interleaved)
