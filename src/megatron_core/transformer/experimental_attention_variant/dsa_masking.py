"""Masks and masked softmaxes of DeepSeek sparse attention (Megatron-Core's ``dsa_masking``, the helpers DSA uses).

Masks are additive float32 tensors: 0 where a query may attend to a key, ``-inf`` where it may not, shaped
``[sq, sk]`` (shared by the batch) or ``[b, sq, sk]``. A top-k selection ``[b, sq, topk]`` holds key indices, -1
for an empty slot (a query with fewer visible keys than ``topk``). The masked softmaxes give exact zeros at
masked entries, and a row with no valid entry gives all zeros instead of NaN.

Packed sequences may instead be described by row-wise key bounds (Megatron-Core's "varlen" form): query row ``i``
sees the keys whose position lies in ``[starts[i], ends[i])`` (``key_positions`` ``[sk]``, by default
``0 .. sk-1``); :func:`resolve_sparse_mask` turns those into the additive mask the PyTorch path uses.
"""

from __future__ import annotations

import torch

__all__ = [
    "build_causal_mask_from_positions",
    "build_valid_mask_from_starts_ends",
    "extract_query_valid_rows_from_packed_seq_params",
    "generate_varlen_mask_params_for_positions",
    "masked_log_softmax",
    "masked_softmax",
    "normalize_query_valid_rows",
    "prepare_additive_mask",
    "resolve_sparse_mask",
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


def generate_varlen_mask_params_for_positions(cu_seqlens: torch.Tensor, query_positions: torch.Tensor
                                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal key bounds ``(starts, ends)`` (int64) of the packed tokens at ``query_positions``: from the start of
    each one's document (``cu_seqlens``, cumulative lengths) up to and including itself."""
    if query_positions.dtype not in (torch.int32, torch.int64):
        raise TypeError("generate_varlen_mask_params_for_positions needs integer query_positions")
    cu = cu_seqlens.reshape(-1).to(device=query_positions.device, dtype=torch.int64)
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries, got {cu.numel()}")
    positions = query_positions.to(torch.int64)
    docs = torch.searchsorted(cu[1:], positions, right=True)
    return cu[docs.clamp_max(cu.numel() - 1)], positions + 1


def build_valid_mask_from_starts_ends(starts: torch.Tensor, ends: torch.Tensor, key_positions: torch.Tensor
                                      ) -> torch.Tensor:
    """Bool ``[sq, sk]``: True where ``starts[i] <= key_positions[j] < ends[i]``."""
    if starts.ndim != 1 or starts.shape != ends.shape or key_positions.ndim != 1:
        raise ValueError(f"starts and ends must be equal 1-D tensors and key_positions 1-D, got "
                         f"{tuple(starts.shape)}, {tuple(ends.shape)}, {tuple(key_positions.shape)}")
    keys = key_positions.to(torch.int64).unsqueeze(0)
    return (keys >= starts.to(torch.int64).unsqueeze(-1)) & (keys < ends.to(torch.int64).unsqueeze(-1))


def resolve_sparse_mask(mask: torch.Tensor | None, varlen_starts: torch.Tensor | None,
                        varlen_ends: torch.Tensor | None, key_positions: torch.Tensor | None, *, sk: int,
                        device: torch.device) -> torch.Tensor | None:
    """The additive mask of either description: ``mask`` itself, or the ``[sq, sk]`` mask of the row bounds
    (``key_positions`` None: ``0 .. sk-1``). Both at once, or bounds without ``varlen_ends``, raise."""
    if varlen_starts is None:
        if varlen_ends is not None or key_positions is not None:
            raise ValueError("varlen_ends / key_positions need varlen_starts")
        return mask
    if mask is not None:
        raise ValueError("pass either an additive mask or varlen_starts / varlen_ends, not both")
    if varlen_ends is None:
        raise ValueError("varlen_starts needs varlen_ends")
    keys = (torch.arange(sk, dtype=torch.int64, device=device) if key_positions is None
            else key_positions.to(device=device))
    valid = build_valid_mask_from_starts_ends(varlen_starts.to(device), varlen_ends.to(device), keys)
    return torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))


def extract_query_valid_rows_from_packed_seq_params(packed_seq_params: object, *, b: int, sq: int,
                                                    device: torch.device) -> torch.Tensor | None:
    """``packed_seq_params.real_token_mask_q`` (this rank's real query rows, when the data pipeline sets it) as a
    bool ``[b, sq]`` tensor, else None (every row counts in the indexer loss)."""
    rows = getattr(packed_seq_params, "real_token_mask_q", None) if packed_seq_params is not None else None
    return normalize_query_valid_rows(rows, b=b, sq=sq, device=device)
