"""Depthwise causal convolution with SiLU over packed variable-length sequences, each behind its own stored inputs
(Megatron-Core 0.19's ``ssm.ops.causal_conv1d_varlen``).

Output token ``t`` of a sequence starting at ``start`` is ``silu(bias + sum_j w[:, j] * tap_j)`` where tap ``j``
reads input ``t - (K - 1) + j`` while that lies in the sequence, else column ``K - 1 - (start - src)`` of the
sequence's initial state ``[conv_dim, K - 1]`` (zeros without initial states or before its first column). One
vectorised gather per tap, fp32 sums, output in ``x``'s dtype, on any device (0.19 launches one Triton kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_varlen_fn"]


def _token_layout(cu_seqlens: torch.Tensor, total_tokens: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence [total_tokens], start [total_tokens])`` of each token; tokens past ``cu_seqlens[-1]`` belong to
    the last sequence's span (its start)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    tokens = torch.arange(total_tokens, device=device)
    sequence = (torch.searchsorted(cu[1:], tokens, right=True)).clamp(max=cu.numel() - 2)
    return sequence, cu[:-1][sequence]


def causal_conv1d_varlen_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            cu_seqlens: torch.Tensor, initial_states: torch.Tensor | None = None,
                            activation: str = "silu", precomputed_seq_idx: torch.Tensor | None = None,
                            precomputed_seq_start: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal depthwise conv)`` of packed sequences: ``x`` ``[total_tokens, conv_dim]``, ``weight``
    ``[conv_dim, K]``, ``bias`` ``[conv_dim]``, ``cu_seqlens`` ``[num_requests + 1]``, ``initial_states``
    ``[num_requests, conv_dim, K - 1]`` (zeros when None); returns ``[total_tokens, conv_dim]`` in ``x``'s dtype.

    ``precomputed_seq_idx`` / ``precomputed_seq_start`` ``[total_tokens]`` (both or neither) give each token's
    request and that request's first token instead of deriving them from ``cu_seqlens`` (padding tokens: request 0).
    """
    if activation != "silu":
        raise ValueError(f"causal_conv1d_varlen_fn: activation must be 'silu', got {activation!r}")
    if (precomputed_seq_idx is None) != (precomputed_seq_start is None):
        raise ValueError("precomputed_seq_idx and precomputed_seq_start must be given together")
    total, conv_dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != conv_dim:
        raise ValueError(f"weight {tuple(weight.shape)} must be ({conv_dim}, d_conv)")
    width = weight.shape[1]
    requests = cu_seqlens.shape[0] - 1
    if precomputed_seq_idx is None and initial_states is not None and \
            initial_states.shape != (requests, conv_dim, width - 1):
        raise ValueError(f"initial_states {tuple(initial_states.shape)} must be ({requests}, {conv_dim}, "
                         f"{width - 1})")
    if precomputed_seq_idx is not None:
        sequence = precomputed_seq_idx.to(device=x.device, dtype=torch.int64)
        start = precomputed_seq_start.to(device=x.device, dtype=torch.int64)
    else:
        sequence, start = _token_layout(cu_seqlens, total, x.device)
    tokens = torch.arange(total, device=x.device)
    xf, w = x.float(), weight.float()
    acc = (bias.float() if bias is not None else xf.new_zeros(conv_dim)).expand(total, conv_dim)
    for j in range(width):
        src = tokens - (width - 1) + j
        inside = (src >= start)[:, None]
        tap = torch.where(inside, xf[src.clamp(min=0)], 0.0)
        if initial_states is not None and width > 1:
            column = (width - 1) - (start - src)
            stored = initial_states.float()[sequence, :, column.clamp(0, width - 2)]
            tap = torch.where(inside | (column < 0)[:, None], tap, stored)
        acc = acc + tap * w[:, j]
    return F.silu(acc).to(x.dtype)
