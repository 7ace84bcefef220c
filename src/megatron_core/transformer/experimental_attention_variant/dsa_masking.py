"""Masks and masked softmaxes of DeepSeek sparse attention (Megatron-Core's ``dsa_masking``, the helpers DSA uses).

Masks are additive float32 tensors: 0 where a query may attend to a key, ``-inf`` where it may not, shaped
``[sq, sk]`` (shared by the batch) or ``[b, sq, sk]``. A top-k selection ``[b, sq, topk]`` holds key indices, -1
for an empty slot (a query with fewer visible keys than ``topk``). The masked softmaxes give exact zeros at
masked entries, and a row with no valid entry gives all zeros instead of NaN.
"""

from __future__ import annotations

import torch

__all__ = [
    "build_causal_mask_from_positions",
    "masked_log_softmax",
    "masked_softmax",
    "normalize_query_valid_rows",
    "prepare_additive_mask",
    "scatter_topk_into_index_mask",
]


def build_causal_mask_from_positions(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Additive ``[len(query_pos), len(key_pos)]`` mask: ``-inf`` where the key's position is after the query's."""
    if query_pos.dtype not in (torch.int32, torch.int64) or key_pos.dtype not in (torch.int32, torch.int64):
        raise TypeError("build_causal_mask_from_positions needs integer query_pos and key_pos")
    mask = torch.zeros((query_pos.numel(), key_pos.numel()), dtype=torch.float32, device=query_pos.device)
    return mask.masked_fill_(key_pos.unsqueeze(0) > query_pos.unsqueeze(-1), float("-inf"))


def prepare_additive_mask(mask: torch.Tensor | None, *, sq: int, sk: int, b: int, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mask`` (or, when None, the causal mask ``[sq, sk]``) and its broadcast views.

    Returns ``(score_mask, attention view [1|b, 1, sq, sk], index view [1|b, sq, sk], valid [b, sq, sk] bool)``.
    """
    if mask is None:
        score_mask = torch.triu(torch.full((sq, sk), float("-inf"), dtype=torch.float32, device=device), diagonal=1)
    else:
        if mask.dtype != torch.float32 or mask.shape not in ((sq, sk), (b, sq, sk)):
            raise ValueError(f"mask must be a float32 [sq, sk] or [b, sq, sk] tensor (sq={sq}, sk={sk}, b={b}), "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        score_mask = mask
    if score_mask.ndim == 2:
        return (score_mask, score_mask.view(1, 1, sq, sk), score_mask.unsqueeze(0),
                torch.isfinite(score_mask).unsqueeze(0).expand(b, sq, sk))
    return score_mask, score_mask.view(b, 1, sq, sk), score_mask, torch.isfinite(score_mask)


def scatter_topk_into_index_mask(index_mask: torch.Tensor, topk_indices: torch.Tensor, *,
                                 seq_chunk_size: int = 256) -> None:
    """Set ``index_mask`` ``[b, sq, sk]`` (filled with ``-inf``) to 0 at each selected key, in place; -1 slots
    select nothing. Works ``seq_chunk_size`` query rows at a time."""
    b, sq, _ = index_mask.shape
    if topk_indices.ndim != 3 or tuple(topk_indices.shape[:2]) != (b, sq):
        raise ValueError(f"topk_indices must be [b, sq, topk] = [{b}, {sq}, *], got {tuple(topk_indices.shape)}")
    for s0 in range(0, sq, max(1, int(seq_chunk_size))):
        idx = topk_indices[:, s0:s0 + seq_chunk_size].to(dtype=torch.int64, device=index_mask.device)
        src = torch.zeros(idx.shape, dtype=index_mask.dtype, device=index_mask.device)
        src = src.masked_fill(idx < 0, float("-inf"))
        index_mask[:, s0:s0 + seq_chunk_size].scatter_reduce_(-1, idx.clamp_min(0), src, reduce="amax",
                                                              include_self=True)


def _check_float_and_shape(name: str, logits: torch.Tensor, valid_mask: torch.Tensor) -> None:
    if not logits.is_floating_point():
        raise TypeError(f"{name} expects a floating-point tensor, got {logits.dtype}")
    if logits.shape != valid_mask.shape:
        raise ValueError(f"{name}: logits {tuple(logits.shape)} and valid_mask {tuple(valid_mask.shape)} differ")


def masked_softmax(logits: torch.Tensor, valid_mask: torch.Tensor, *, dim: int = -1, eps: float = 1e-10
                   ) -> torch.Tensor:
    """Softmax over the entries where ``valid_mask`` is True; 0 elsewhere and on rows with no valid entry."""
    _check_float_and_shape("masked_softmax", logits, valid_mask)
    masked = logits.masked_fill(~valid_mask, torch.finfo(logits.dtype).min)
    row_max = masked.max(dim=dim, keepdim=True).values
    row_max = torch.where(valid_mask.any(dim=dim, keepdim=True), row_max, torch.zeros_like(row_max))
    probs = torch.exp(masked - row_max).masked_fill(~valid_mask, 0.0)
    probs = probs / probs.sum(dim=dim, keepdim=True).clamp_min(eps)
    return probs.masked_fill(~valid_mask, 0.0)


def masked_log_softmax(logits: torch.Tensor, valid_mask: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
    """Log-softmax over the entries where ``valid_mask`` is True; 0 elsewhere (no gradient flows there)."""
    _check_float_and_shape("masked_log_softmax", logits, valid_mask)
    masked = logits.masked_fill(~valid_mask, torch.finfo(logits.dtype).min)
    safe = torch.where(valid_mask.any(dim=dim, keepdim=True), masked, torch.zeros_like(masked))
    return torch.log_softmax(safe, dim=dim).masked_fill(~valid_mask, 0.0)


def normalize_query_valid_rows(query_valid_rows: torch.Tensor | None, *, b: int, sq: int, device: torch.device
                               ) -> torch.Tensor | None:
    """An optional real-query-row mask (``[sq]``, ``[1, sq]`` or ``[b, sq]``) as a bool ``[b, sq]`` tensor."""
    if query_valid_rows is None:
        return None
    rows = query_valid_rows.to(device=device, dtype=torch.bool)
    if rows.ndim == 1 and rows.numel() == sq:
        return rows.unsqueeze(0).expand(b, sq)
    if rows.ndim == 2 and tuple(rows.shape) == (1, sq):
        return rows.expand(b, sq)
    if rows.ndim == 2 and tuple(rows.shape) == (b, sq):
        return rows
    raise ValueError(f"query_valid_rows must be [sq], [1, sq] or [b, sq] with b={b}, sq={sq}, got "
                     f"{tuple(rows.shape)}")
