"""The largest pre-softmax attention logit of each head (QK-clip's statistic, ``log_max_attention_logit``).

SDPA and the flash kernels return no logits, so the maximum of ``Q K^T * scale`` over the positions a query may
attend (masked, causal and sliding-window positions excluded; attention biases and sink logits not included) is
computed in a separate pass without gradients, in fp32, over row tiles of at most ``_TILE_ELEMENTS`` scores. It
reads the same query and key as the attention and leaves the attention's output and gradients untouched.
Under context parallelism each rank gathers the whole key sequence and takes the maximum over its own query
rows (Megatron's load-balanced chunk order); the ranks' maxima are combined by ``clip_qk``'s all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.transformer.attention_kernels import window_keep

__all__ = ["context_parallel_max_logits", "max_logits", "update_running_max"]

_TILE_ELEMENTS = 1 << 26  # fp32 scores per row tile (256 MiB)


@torch.no_grad()
def max_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, keep: torch.Tensor | None = None, *, causal: bool = False
) -> torch.Tensor:
    """Per query head, the largest ``q . k * scale`` over the visible pairs; fp32 ``[heads]``.

    ``q`` is ``[b, heads, sq, d]`` and ``k`` ``[b, groups, sk, d]`` (``heads`` a multiple of ``groups``).
    ``keep`` (True = attend) broadcasts to ``[b, heads, sq, sk]``; ``causal`` hides keys ``j > i`` (SDPA's
    top-left ``is_causal``). A head that sees no pair gets ``-inf``.
    """
    b, heads, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    per_group = heads // groups
    kt = k.detach().float().transpose(-1, -2).unsqueeze(2)  # [b, g, 1, d, sk]
    q = q.detach()
    if keep is not None and keep.dim() < 4:
        keep = keep.view(*(1,) * (4 - keep.dim()), *keep.shape)
    rows = max(1, _TILE_ELEMENTS // max(1, b * heads * sk))
    best = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    for start in range(0, sq, rows):
        stop = min(start + rows, sq)
        tile = q[:, :, start:stop].float().reshape(b, groups, per_group, stop - start, d)
        scores = torch.matmul(tile, kt).mul_(scale).view(b, heads, stop - start, sk)
        if keep is not None:
            rows_keep = keep if keep.shape[-2] == 1 else keep[..., start:stop, :]
            scores.masked_fill_(~rows_keep.bool(), float("-inf"))
        if causal:
            q_pos = torch.arange(start, stop, device=q.device)
            hidden = torch.arange(sk, device=q.device)[None, :] > q_pos[:, None]
            scores.masked_fill_(hidden, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


@torch.no_grad()
def context_parallel_max_logits(
    q: torch.Tensor, k: torch.Tensor, cp_group: Any, scale: float, causal: bool, window: tuple[int, int] | None
) -> torch.Tensor:
    """Per head, the largest logit of this CP rank's queries ``[s/cp, b, heads, d]`` over the whole sequence.

    ``k`` is this rank's ``[s/cp, b, groups, d]`` in Megatron's load-balanced order (rank ``r`` holds chunks
    ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``); positions are the global ones for the causal / window pattern.
    """
    n, rank = get_pg_size(cp_group), get_pg_rank(cp_group)
    k = k.detach().contiguous()
    parts = [torch.empty_like(k) for _ in range(n)]
    torch.distributed.all_gather(parts, k, group=cp_group)
    c = q.shape[0] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * n)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * n - 1 - r] = part[:c], part[c:]
    k_all = torch.cat(chunks, dim=0).permute(1, 2, 0, 3)  # [b, g, s, d] in sequence order
    seq = k_all.shape[2]
    best = None
    for a, chunk in enumerate((rank, 2 * n - 1 - rank)):
        q_pos = torch.arange(chunk * c, (chunk + 1) * c, device=q.device)
        keep = None
        if causal or window is not None:
            keep = window_keep(c, seq, window, causal, q.device, q_pos=q_pos, k_pos=torch.arange(seq, device=q.device))
        value = max_logits(q[a * c:(a + 1) * c].permute(1, 2, 0, 3), k_all, scale, keep)
        best = value if best is None else torch.maximum(best, value)
    return best


def update_running_max(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of the recorded maxima and a new forward's (``new`` when none are recorded)."""
    new = new.detach()
    return new if current is None else torch.maximum(current, new)
