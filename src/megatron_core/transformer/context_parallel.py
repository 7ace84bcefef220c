"""Context-parallel core attention: ring ("p2p"), "all_gather", Ulysses ("a2a") and "a2a+p2p".

Each CP rank holds ``s / cp`` tokens in Megatron's load-balanced order: the sequence is cut into
``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (see
``megatron_core.utils.get_batch_on_this_cp_rank``), so causal work is even across ranks.

* ``p2p``: key/value blocks travel around the CP ring (the next block's transfer is posted before
  the current block is computed); partial outputs are merged with their log-sum-exp. The backward is
  a custom autograd function that runs the same ring again, sending each key/value block's gradient
  along with it until it is back at its owner. Only the (query chunk, key chunk) pairs that the
  causal / sliding-window pattern does not hide entirely are computed.
* ``all_gather``: key/value are gathered (backward: reduce-scatter) and each local query chunk
  attends to the keys up to its own position with SDPA.
* ``a2a``: Ulysses all-to-all: each rank trades its sequence slice of all heads for the full
  sequence of ``heads / cp`` heads, runs plain causal SDPA, and trades back.
* ``a2a+p2p``: all-to-all inside the first hierarchical group, ring attention across the second.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.transformer.attention_kernels import attend, block_backward, block_forward, window_keep
from megatron_core.transformer.cp_mappings import (
    all_gather_sequence,
    heads_to_sequence,
    ring_exchange,
    sequence_to_heads,
)

__all__ = ["CP_COMM_TYPES", "context_parallel_attention"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _pair_plan(
    q_chunks: tuple[int, int], k_chunks: tuple[int, int], c: int, causal: bool,
    window: tuple[int, int] | None, device: torch.device,
) -> list[tuple[int, int, torch.Tensor | None]]:
    """(local q chunk, local k chunk, keep mask or None) for every pair not entirely masked."""
    left, right = window if window is not None else (-1, -1)
    plan = []
    for a, qc in enumerate(q_chunks):
        for b, kc in enumerate(k_chunks):
            lo, hi = (qc - kc) * c - (c - 1), (qc - kc) * c + (c - 1)  # range of q_pos - k_pos
            hidden = (causal and hi < 0) or (left >= 0 and lo > left) or (right >= 0 and hi < -right)
            if hidden:
                continue
            visible = (not causal or lo >= 0) and (left < 0 or hi <= left) and (right < 0 or lo >= -right)
            keep = None
            if not visible:
                pos = torch.arange(c, device=device)
                keep = window_keep(c, c, window, causal, device, q_pos=pos + qc * c, k_pos=pos + kc * c)
            plan.append((a, b, keep))
    return plan


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo_lse: torch.Tensor, rows: slice) -> None:
    old = lse[:, :, rows]
    new = torch.logaddexp(old, lo_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(old - safe).unsqueeze(-1)
    w_new = torch.exp(lo_lse - safe).unsqueeze(-1)
    out[:, :, rows] = out[:, :, rows] * w_old + o * w_new
    lse[:, :, rows] = new


def _chunks(rank: int, n: int) -> tuple[int, int]:
    return rank, 2 * n - 1 - rank


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``group``; q ``[b, h, s, d]``, k/v ``[b, hk, s, d]`` in load-balanced order."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                window: tuple[int, int] | None, scale: float) -> torch.Tensor:
        n, rank = get_pg_size(group), get_pg_rank(group)
        c = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(n):
            nxt, works = ring_exchange(kv, group) if step < n - 1 else (None, [])
            src = (rank - step) % n
            for a, b, keep in _pair_plan(_chunks(rank, n), _chunks(src, n), c, causal, window, q.device):
                rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                o, l_ = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, keep)
                _merge(out, lse, o, l_, rows)
            for work in works:
                work.wait()
            if nxt is not None:
                kv = nxt
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.causal, ctx.window, ctx.scale = group, causal, window, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, window, scale = ctx.group, ctx.causal, ctx.window, ctx.scale
        n, rank = get_pg_size(group), get_pg_rank(group)
        c = q.shape[2] // 2
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_recv: torch.Tensor | None = None
        dkv_works: list = []
        for step in range(n):
            nxt, works = ring_exchange(kv, group) if step < n - 1 else (None, [])
            src = (rank - step) % n
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for a, b, keep in _pair_plan(_chunks(rank, n), _chunks(src, n), c, causal, window, q.device):
                rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                gq, gk, gv = block_backward(
                    dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], lse[:, :, rows],
                    delta[:, :, rows], scale, keep,
                )
                dq[:, :, rows] += gq
                dkv[0][:, :, cols] += gk
                dkv[1][:, :, cols] += gv
            for work in dkv_works:
                work.wait()
            if dkv_recv is not None:
                dkv += dkv_recv
            # This block's gradient follows the block to the next rank; after the last step it is home.
            dkv_recv, dkv_works = ring_exchange(dkv, group)
            for work in works:
                work.wait()
            if nxt is not None:
                kv = nxt
        for work in dkv_works:
            work.wait()
        return dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype), None, None, None, None


def _to_coarse(x: torch.Tensor, n: int) -> torch.Tensor:
    """After an all-to-all over ``n`` ranks ``[A0, B0, A1, B1, ...]`` -> ``[A0 .. A(n-1), B(n-1) .. B0]``."""
    if n == 1:
        return x
    parts = x.reshape(n, 2, x.shape[0] // (2 * n), *x.shape[1:])
    return torch.cat([parts[:, 0].flatten(0, 1), parts[:, 1].flip(0).flatten(0, 1)], dim=0)


def _from_coarse(x: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`_to_coarse`."""
    if n == 1:
        return x
    c = x.shape[0] // (2 * n)
    firsts = x[: n * c].reshape(n, c, *x.shape[1:])
    seconds = x[n * c:].reshape(n, c, *x.shape[1:]).flip(0)
    return torch.stack([firsts, seconds], dim=1).flatten(0, 2)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _all_gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
    window: tuple[int, int] | None, scale: float, dropout_p: float,
) -> torch.Tensor:
    n, rank = get_pg_size(group), get_pg_rank(group)
    c = q.shape[0] // 2
    # Gathered chunks are in rank order [0, 2n-1, 1, 2n-2, ...]; put them in sequence order.
    order = [2 * j if j < n else 2 * (2 * n - 1 - j) + 1 for j in range(2 * n)]
    index = torch.tensor(order, device=q.device)

    def natural(x: torch.Tensor) -> torch.Tensor:
        full = all_gather_sequence(x, group)
        return full.reshape(2 * n, c, *x.shape[1:]).index_select(0, index).flatten(0, 1)

    k_all, v_all = natural(k), natural(v)
    if not causal:
        return attend(_bhsd(q), _bhsd(k_all), _bhsd(v_all), causal=False, scale=scale, dropout_p=dropout_p)
    left = window[0] if window is not None else -1
    outs = []
    for a, chunk in enumerate(_chunks(rank, n)):
        hi = (chunk + 1) * c
        lo = max(0, chunk * c - left) if left >= 0 else 0
        outs.append(attend(
            _bhsd(q[a * c:(a + 1) * c]), _bhsd(k_all[lo:hi]), _bhsd(v_all[lo:hi]), causal=True, scale=scale,
            window=window, dropout_p=dropout_p,
        ))
    return torch.cat(outs, dim=2)


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm_type: str, cp_group: Any,
    hierarchical_groups: list | None = None, causal: bool = True, window: tuple[int, int] | None = None,
    scale: float, dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of this CP rank's ``q`` ``[s/cp, b, h, d]`` over the whole sequence; returns ``[b, h, s/cp, d]``."""
    if q.shape[0] % 2 != 0:
        raise ValueError(f"context parallelism needs an even local sequence length (2 chunks per rank), got {q.shape[0]}")
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, cp_group, causal, window, scale, dropout_p)
    if comm_type == "p2p":
        a2a_group, p2p_group = None, cp_group
    elif comm_type == "a2a":
        a2a_group, p2p_group = cp_group, None
    elif comm_type == "a2a+p2p":
        if not hierarchical_groups or len(hierarchical_groups) != 2:
            raise ValueError(
                "cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes [a2a_size, p2p_size] "
                "(two hierarchical context-parallel groups)"
            )
        a2a_group, p2p_group = hierarchical_groups
    else:
        raise ValueError(f"cp_comm_type ({comm_type!r}) must be one of {list(CP_COMM_TYPES)}")
    n_a2a = get_pg_size(a2a_group) if a2a_group is not None else 1
    if n_a2a > 1:
        q, k, v = (_to_coarse(sequence_to_heads(x, a2a_group), n_a2a) for x in (q, k, v))
    n_p2p = get_pg_size(p2p_group) if p2p_group is not None else 1
    if n_p2p == 1:
        out = attend(_bhsd(q), _bhsd(k), _bhsd(v), causal=causal, scale=scale, window=window, dropout_p=dropout_p)
    else:
        if dropout_p > 0.0:
            raise ValueError(
                f"attention_dropout ({dropout_p}) is not supported with cp_comm_type {comm_type!r} (ring attention); "
                "use 'all_gather' or 'a2a', or attention_dropout=0"
            )
        out = _RingAttention.apply(_bhsd(q), _bhsd(k), _bhsd(v), p2p_group, causal, window, scale)
    if n_a2a > 1:
        out = _bhsd(heads_to_sequence(_from_coarse(out.permute(2, 0, 1, 3), n_a2a), a2a_group))
    return out
