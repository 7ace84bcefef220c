"""Attention kernels on PyTorch's SDPA, plus the block forward/backward used by ring attention.

Tensors are ``[b, heads, s, d]`` (SDPA's layout); key/value may have fewer heads (GQA).
``window`` is Megatron's ``(left, right)``: query ``i`` sees keys ``j`` with
``i - left <= j <= i + right`` (``-1`` = unbounded), positions aligned bottom-right when
``sq != sk``; ``causal`` additionally hides every ``j > i``.

:func:`block_forward` returns the block's output and its log-sum-exp (fp32) and
:func:`block_backward` computes the block's gradients from the *merged* output and log-sum-exp
(the flash-attention backward identity), so ring attention can merge partial results exactly.
They compute in fp32 on any device, materialising one block's ``[sq, sk]`` scores.

:func:`attend_with_sink` is SDPA with an attention sink (``softmax_type`` 'off-by-one' / 'learnable').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = ["attend", "attend_with_sink", "block_backward", "block_forward", "window_keep"]


def window_keep(
    sq: int, sk: int, window: tuple[int, int] | None, causal: bool, device: torch.device,
    q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[sq, sk]`` boolean (True = attend) for a causal and/or sliding-window pattern."""
    if q_pos is None:
        q_pos = torch.arange(sq, device=device) + (sk - sq)
    if k_pos is None:
        k_pos = torch.arange(sk, device=device)
    diff = q_pos[:, None] - k_pos[None, :]  # how far the key lies behind the query
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    left, right = window if window is not None else (-1, -1)
    if causal:
        keep &= diff >= 0
    if left >= 0:
        keep &= diff <= left
    if right >= 0:
        keep &= diff >= -right
    return keep


def _is_full_window(window: tuple[int, int] | None, causal: bool) -> bool:
    if window is None:
        return True
    left, right = window
    return left < 0 and (causal or right < 0)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
    window: tuple[int, int] | None = None, dropout_p: float = 0.0, mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA with an optional causal/window pattern (is_causal fast path when it is plainly causal)."""
    sq, sk = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    is_causal = False
    if mask is None and _is_full_window(window, causal):
        if causal and sq == sk:
            is_causal = True if sq > 1 else False  # noqa: SIM210 (a Python bool under dynamic shapes)
        elif causal:
            # A lower-right causal bias keeps SDPA on its fused kernels (no [sq, sk] tensor).
            mask = causal_lower_right(sq, sk)
    elif causal or not _is_full_window(window, causal):
        pattern = window_keep(sq, sk, window, causal, q.device)
        mask = pattern if mask is None else mask & pattern
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )


def attend_with_sink(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, *, scale: float,
    mask: torch.Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA whose softmax also sees, in every row, one extra logit ``sink[h]`` per query head (an attention sink).

    ``mask`` is SDPA's (bool, True = attend, or additive float) over the real keys, or None; ``is_causal`` is
    SDPA's top-left causal flag. The sink is an extra key, visible to every query, whose value is zero: it
    only enlarges the softmax's denominator by ``exp(sink[h])``. Its logit travels on one extra channel (the
    query holds ``sink[h] / scale`` there, the sink key 1, every real key 0; zero channels pad the head size to
    a multiple of 8), so keys and values stay per key/value head (GQA) and the plain causal case keeps SDPA's
    fused kernels (a lower-right causal bias over the prepended sink). Gradients reach ``sink`` through the
    query's extra channel.
    """
    b, heads, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    extra = 8 - d % 8  # channel d carries the sink; the head size stays a multiple of 8 for the fused kernels
    logit = (sink.float() / scale).to(q.dtype).view(1, heads, 1, 1).expand(b, heads, sq, 1)
    q = torch.cat((q, F.pad(logit, (0, extra - 1))), dim=-1)
    sink_key = k.new_zeros(b, groups, 1, d + extra)
    sink_key[..., d] = 1
    k = torch.cat((sink_key, F.pad(k, (0, extra))), dim=2)
    v = F.pad(v, (0, extra, 1, 0))  # a zero value row for the sink; zero channels keep q, k and v alike
    if is_causal and sq == sk:
        mask = causal_lower_right(sq, sk + 1)
    else:
        if is_causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            mask = mask.expand(*mask.shape[:-2], sq, sk)
            visible = mask.new_ones(*mask.shape[:-1], 1) if mask.dtype == torch.bool else mask.new_zeros(
                *mask.shape[:-1], 1)
            mask = torch.cat((visible, mask), dim=-1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=groups != heads
    )
    return out[..., :d]


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    if k.shape[1] == heads:
        return k
    return k.repeat_interleave(heads // k.shape[1], dim=1)


def _reduce_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    if h == kv_heads:
        return grad
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


_TILE_ELEMENTS = 1 << 27  # fp32 scores per row tile (512 MiB), bounds the block kernels' memory


def _row_tiles(q: torch.Tensor, sk: int) -> list[slice]:
    b, h, sq = q.shape[:3]
    rows = max(1, _TILE_ELEMENTS // max(1, b * h * sk))
    return [slice(i, min(i + rows, sq)) for i in range(0, sq, rows)]


def _tile_keep(keep: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if keep is None else keep[rows]


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's ``(out fp32 [b, h, sq, d], lse fp32 [b, h, sq])``; fully masked rows give lse = -inf, out = 0.

    ``keep`` is ``[sq, sk]`` (True = attend) or None. Rows are processed in tiles so that at most
    ``_TILE_ELEMENTS`` scores exist at a time.
    """
    heads = q.shape[1]
    ke, ve = _expand_kv(k, heads).float(), _expand_kv(v, heads).float()
    outs, lses = [], []
    for rows in _row_tiles(q, k.shape[2]):
        scores = _scores(q[:, :, rows], ke, scale, _tile_keep(keep, rows))
        lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(scores - safe.unsqueeze(-1))
        del scores
        outs.append(torch.matmul(probs, ve))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, scale: float, keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (fp32) of one block given the merged ``lse`` and ``delta = rowsum(dout * out)``."""
    heads = q.shape[1]
    ke, ve = _expand_kv(k, heads).float(), _expand_kv(v, heads).float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(ve.shape, dtype=torch.float32, device=q.device)
    for rows in _row_tiles(q, k.shape[2]):
        q_t = q[:, :, rows].float()
        scores = _scores(q_t, ke, scale, _tile_keep(keep, rows))
        lse_t = lse[:, :, rows]
        safe = torch.where(torch.isinf(lse_t), torch.zeros_like(lse_t), lse_t)
        probs = torch.exp(scores - safe.unsqueeze(-1))
        del scores
        dout_t = dout[:, :, rows].float()
        dv += torch.matmul(probs.transpose(-1, -2), dout_t)
        dprobs = torch.matmul(dout_t, ve.transpose(-1, -2))
        dscores = probs * (dprobs - delta[:, :, rows].unsqueeze(-1)) * scale
        del probs, dprobs
        dq[:, :, rows] = torch.matmul(dscores, ke)
        dk += torch.matmul(dscores.transpose(-1, -2), q_t)
    return dq, _reduce_kv(dk, k.shape[1]), _reduce_kv(dv, v.shape[1])
