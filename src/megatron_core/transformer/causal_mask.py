"""Megatron mask tensors -> SDPA arguments, and recognition of the plain causal mask.

Megatron's GPT datasets and training loops pass an explicit boolean causal mask (``True`` =
masked, ``[1, 1, s, s]`` or ``[b, 1, s, s]``) even for causal layers; given to SDPA it would force
the slower masked kernels. :func:`is_plain_causal_mask` decides whether a mask is exactly that
pattern (strict upper triangle masked, nothing else, for every batch entry). The answer is cached
per mask tensor (identity, version counter, data pointer, shape, strides), so one micro-batch
costs one comparison and one device->host sync however many layers ask; a mask modified in place
is checked again. It runs outside ``torch.compile`` graphs (``torch.compiler.disable``);
``TransformerBlock`` asks once per forward and, when every attention layer is causal, passes no
mask to the layers at all.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from megatron_core.transformer.enums import AttnMaskType

__all__ = ["drop_plain_causal_mask", "is_causal_rows", "is_plain_causal_mask", "sdpa_mask"]

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)
_CACHE: dict[tuple, tuple[Any, bool]] = {}
_CACHE_LIMIT = 32


def _signature(mask: torch.Tensor, rows: tuple | None) -> tuple:
    return (id(mask), mask._version, mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), mask.dtype,
            str(mask.device), rows)


def _cached(mask: torch.Tensor, rows: tuple | None, compute: Any) -> bool:
    key = _signature(mask, rows)
    entry = _CACHE.get(key)
    if entry is not None and entry[0]() is mask:
        return entry[1]
    result = bool(compute())
    if len(_CACHE) >= _CACHE_LIMIT:
        for stale in [k for k, (ref, _) in _CACHE.items() if ref() is None] or list(_CACHE)[: _CACHE_LIMIT // 2]:
            _CACHE.pop(stale, None)
    _CACHE[key] = (weakref.ref(mask), result)
    return result


@torch.compiler.disable
def is_causal_rows(mask: torch.Tensor, rows: list[int], seq_len: int) -> bool:
    """Whether ``mask`` ``[..., len(rows), seq_len]`` holds rows ``rows`` of the plain causal mask.

    A full ``[..., seq_len, seq_len]`` plain causal mask is accepted too.
    """
    if mask.dim() < 2 or mask.shape[-1] != seq_len:
        return False
    if mask.shape[-2] == seq_len and len(rows) != seq_len:
        return is_plain_causal_mask(mask, seq_len, seq_len)
    if mask.shape[-2] != len(rows):
        return False

    def compute() -> bool:
        q_pos = torch.tensor(rows, device=mask.device)
        expected = torch.arange(seq_len, device=mask.device)[None, :] > q_pos[:, None]
        return torch.equal(mask != 0, expected.expand(mask.shape))

    return _cached(mask, tuple(rows), compute)


@torch.compiler.disable
def is_plain_causal_mask(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether ``mask`` (True/nonzero = masked) is exactly the ``[sq, sk]`` causal pattern (``sq == sk``).

    Cached per tensor: the first call compares on the mask's device and syncs once; later calls
    for the same, unmodified tensor are free.
    """
    if sq != sk or mask.dim() < 2 or tuple(mask.shape[-2:]) != (sq, sk):
        return False

    def compute() -> bool:
        expected = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(diagonal=1)
        return torch.equal(mask != 0, expected.expand(mask.shape))

    return _cached(mask, None, compute)


def drop_plain_causal_mask(module: torch.nn.Module, mask: torch.Tensor | None) -> torch.Tensor | None:
    """``None`` when every core attention in ``module`` is causal and ``mask`` is the plain causal mask."""
    if mask is None:
        return None
    all_causal = module.__dict__.get("_mcore_all_causal_attention")
    if all_causal is None:
        # DotProductAttention (which imports this module) marks itself with ``is_dot_product_attention``.
        attention = [m for m in module.modules() if getattr(type(m), "is_dot_product_attention", False)]
        owners = [m for m in module.modules() if hasattr(m, "core_attention")]
        all_causal = (
            bool(attention) and len(attention) == len(owners)
            and all(m.attn_mask_type in _CAUSAL_TYPES for m in attention)
        )
        module.__dict__["_mcore_all_causal_attention"] = all_causal
    if all_causal and mask.dim() >= 2 and mask.shape[-1] == mask.shape[-2]:
        if is_plain_causal_mask(mask, mask.shape[-2], mask.shape[-1]):
            return None
    return mask


def sdpa_mask(
    mask_type: AttnMaskType, attention_mask: torch.Tensor | None, sq: int, sk: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """Translate Megatron's mask (True = masked) to SDPA's (True = attend) plus an ``is_causal`` flag."""
    if mask_type == AttnMaskType.no_mask:
        return None, False
    if mask_type in _CAUSAL_TYPES and attention_mask is not None and is_plain_causal_mask(attention_mask, sq, sk):
        attention_mask = None
    if mask_type in _CAUSAL_TYPES and attention_mask is None:
        if sq == sk or mask_type == AttnMaskType.causal:
            # A branch (not ``sq > 1`` itself) so that the flag stays a Python bool under dynamic shapes.
            return None, (True if sq > 1 else False)  # noqa: SIM210
        return _causal_keep(sq, sk, device), False
    if attention_mask is None:
        if mask_type == AttnMaskType.padding_causal:
            return _causal_keep(sq, sk, device), False
        return None, False
    keep = ~attention_mask.bool()
    if mask_type == AttnMaskType.padding_causal:
        keep = keep & _causal_keep(sq, sk, device)
    return keep, False


def _causal_keep(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal pattern: query i sees keys up to ``i + sk - sq``."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
